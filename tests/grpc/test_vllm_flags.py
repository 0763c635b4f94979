"""vLLM's engine arguments on `server`: each is accepted and reaches the
engine setting it names, or is refused with one line saying why (exit 2)."""

from __future__ import annotations

import logging

import pytest
import torch

from tokenbudget.core.pooling_params import PoolerConfig
from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.proto import generate_pb2
from tokenbudget.server.entrypoints import cli
from tokenbudget.server.engine.args import EngineArgs
from tokenbudget.server.engine.request_limits import RequestLimits
from tokenbudget.server.entrypoints.grpc.generation import GenerationServicer

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"

# Flags checked on the settings they produce, without loading a model:
# (argv, what the settings must hold).
SETTINGS = [
    (["--enable-prefix-caching"], lambda s: s.cache.enable_prefix_caching is True),
    (["--no-enable-prefix-caching"], lambda s: s.cache.enable_prefix_caching is False),
    (["--no-prefix-caching"], lambda s: s.cache.enable_prefix_caching is False),
    (["--num-gpu-blocks-override", "40"], lambda s: s.cache.num_blocks == 40),
    (["--kv-cache-memory-bytes", "1048576"], lambda s: s.cache.kv_cache_memory_bytes == 1 << 20),
    (["--kv-cache-memory-bytes", "2GiB"], lambda s: s.cache.kv_cache_memory_bytes == 2 << 30),
    (["--scheduling-policy", "priority"], lambda s: s.sched.policy == "priority"),
    # The host KV tier and KV cache events (issue 14).
    (["--kv-offload-memory", "8GiB"], lambda s: s.cache.kv_offload_memory_bytes == 8 << 30),
    (
        ["--num-offload-blocks", "64", "--kv-load-blocks-per-step", "32"],
        lambda s: (s.cache.num_offload_blocks, s.cache.kv_load_blocks_per_step) == (64, 32),
    ),
    (["--enable-kv-cache-events"], lambda s: s.cache.enable_kv_cache_events is True),
    (["--async-scheduling"], lambda s: s.sched.async_scheduling is True),
    (["--no-async-scheduling"], lambda s: s.sched.async_scheduling is False),
    (["--enable-chunked-prefill"], lambda s: s.args.enable_chunked_prefill is True),
    (["--max-num-partial-prefills", "1"], lambda s: s.args.max_num_partial_prefills == 1),
    (["--enforce-eager"], lambda s: s.args.enforce_eager is True),  # no compile, no graphs
    (["--trust-remote-code"], lambda s: s.args.trust_remote_code is True),
    (["--disable-log-stats"], lambda s: s.metrics.stats_logger.interval == 0),
    (["--enable-log-requests"], lambda s: s.metrics.stats_logger.request_level == logging.INFO),
    (
        ["--log-level", "critical"],
        lambda s: logging.getLogger("tokenbudget").level == logging.CRITICAL,
    ),
    # Our own scheduling flags for the SLO and fair-share policies (issue 15).
    (
        ["--policy", "slo", "--slo-reject-late", "--slo-step-time-ms", "12.5"],
        lambda s: (
            (s.sched.policy, s.sched.slo_reject_late, s.sched.slo_step_time_ms)
            == ("slo", True, 12.5)
        ),
    ),
    (["--tensor-parallel-size", "2"], lambda s: s.args.tensor_parallel_size == 2),
    (["-tp", "4"], lambda s: s.args.tensor_parallel_size == 4),
    (
        ["--fair-share", "--tenant-weights", '{"gold": 4, "free": 1}'],
        lambda s: s.sched.fair_share and s.sched.tenant_weights == {"gold": 4.0, "free": 1.0},
    ),
    (["--fair-share"], lambda s: s.sched.fair_share_chunk_cap is True),
    (
        ["--fair-share", "--no-fair-share-chunk-cap"],
        lambda s: s.sched.fair_share_chunk_cap is False,
    ),
    # Speculative decoding (issue 13): vLLM's JSON.
    (
        [
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_min": 2, "prompt_lookup_max": 5}',
        ],
        lambda s: (
            (
                s.sched.num_speculative_tokens,
                s.sched.speculative_config.prompt_lookup_min,
                s.sched.speculative_config.prompt_lookup_max,
                s.sched.async_scheduling,
            )
            == (4, 2, 5, True)
        ),
    ),
    (
        [
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
            "--no-async-scheduling",
        ],
        lambda s: (
            (s.sched.speculative_config.prompt_lookup_min, s.sched.async_scheduling) == (4, False)
        ),
    ),
    ([], lambda s: s.sched.speculative_config is None and s.sched.async_scheduling is True),
    # vLLM's serve flags that are ours under another name or unit (issue 24).
    (["--swap-space", "4"], lambda s: s.cache.kv_offload_memory_bytes == 4 << 30),
    (["--swap-space", "0"], lambda s: s.cache.kv_offload_memory_bytes is None),
    (
        ["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq"}'],
        lambda s: s.cache.enable_kv_cache_events is True,
    ),
    (
        ["--kv-events-config", '{"enable_kv_cache_events": false}'],
        lambda s: s.cache.enable_kv_cache_events is False,
    ),
    (
        ["--limit-mm-per-prompt", '{"image": 2, "video": 0}'],
        lambda s: (
            s.args.limit_mm_per_prompt == {"image": 2, "video": 0}
            and s.args.input_limits(64)["max_images_per_prompt"] == 2
        ),
    ),
    (
        ["--limit-mm-per-prompt", '{"image": {"count": 1}}'],
        lambda s: s.args.input_limits(64)["max_images_per_prompt"] == 1,
    ),
    (["--tokenizer-mode", "auto"], lambda s: s.args.tokenizer_mode == "auto"),
    (["--download-dir", "/tmp/hub"], lambda s: s.args.download_dir == "/tmp/hub"),
    # Accepted at the value that asks for what the server does anyway: the
    # same settings as without them.
    (
        [
            "--pipeline-parallel-size",
            "1",
            "--data-parallel-size",
            "1",
            "--cpu-offload-gb",
            "0",
            "--load-format",
            "safetensors",
            "--distributed-executor-backend",
            "mp",
        ],
        lambda s: (s.sched, s.cache) == (_Settings([]).sched, _Settings([]).cache),
    ),
    # vLLM's positional model.
    (["some/model"], lambda s: s.args.model == "some/model"),
    (["some/model", "--model", "some/model"], lambda s: s.args.model == "some/model"),
]

# Flags refused before anything loads: (argv, the reason's words).
REFUSED = [
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype='fp8' is not supported: the attention kernels"),
    (["--kv-cache-dtype", "fp8_e5m2"], "is not supported: the attention kernels"),
    (
        ["--no-enable-chunked-prefill"],
        "enable_chunked_prefill=False is not supported: the token-budget scheduler always splits",
    ),
    (["--max-num-partial-prefills", "4"], "max_num_partial_prefills=4 is not supported"),
    (["--worker-secret-file", "/nonexistent/secret"], "--worker-secret-file needs --worker"),
    (
        ["--worker", "127.0.0.1:1", "--worker-secret-file", "/nonexistent/secret"],
        "--worker-secret-file: cannot read /nonexistent/secret",
    ),
    (["--tls-cert", "/nonexistent/cert.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-client-ca", "/nonexistent/ca.pem"], "--tls-client-ca needs --tls-cert and --tls-key"),
    (
        ["--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"],
        "--tls-key: cannot read /nonexistent/k.pem",
    ),
    (["--max-concurrent-rpcs", "0"], "--max-concurrent-rpcs must be >= 1"),
    (
        ["--worker", "127.0.0.1:1", "--worker-connect-timeout", "0"],
        "--worker-connect-timeout must be > 0, got 0.0",
    ),
    (["--revision", "v1", "--worker", "127.0.0.1:1"], "--revision with --worker is not supported"),
    (
        ["--pooler-config", '{"pooling_type": "max"}'],
        "pooler_config.pooling_type must be one of LAST, MEAN, CLS, got 'max'",
    ),
    (
        ["--override-pooler-config", '{"dimensions": 8}'],
        "pooler_config.dimensions: not supported (only pooling_type and normalize)",
    ),
    # Bad speculative configs name the field (issue 13).
    (
        ["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
        "speculative_config.method must be one of 'ngram', got 'eagle'",
    ),
    (
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}'],
        "speculative_config: unknown key 'model'",
    ),
    (
        [
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 2, '
            '"prompt_lookup_min": 4, "prompt_lookup_max": 2}',
        ],
        "speculative_config.prompt_lookup_min (4) must be <= prompt_lookup_max (2)",
    ),
    (
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
        "speculative_config.num_speculative_tokens must be >= 1, got 0",
    ),
    (
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": "4"}'],
        "speculative_config.num_speculative_tokens must be an integer, got '4'",
    ),
    (
        ["--speculative-config", '{"method": "ngram"}'],
        "speculative_config.num_speculative_tokens is required",
    ),
    (
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2'],
        "speculative_config is not valid JSON",
    ),
    (["--speculative-config", "[2]"], "speculative_config must be a dict"),
    (
        ["--tensor-parallel-size", "2", "--worker", "127.0.0.1:1"],
        "--tensor-parallel-size with "
        "--worker is not supported: ranks on other hosts are started with",
    ),
    (
        ["--tensor-parallel-size", "2", "--trust-remote-code"],
        "trust_remote_code with tensor_parallel_size > 1 is not supported",
    ),
    (["--tensor-parallel-size", "0"], "tensor_parallel_size must be >= 1, got 0"),
    # vLLM's serve flags with nothing to honour here: why, and what to use instead (issue 24).
    (
        ["--pipeline-parallel-size", "2"],
        "--pipeline-parallel-size 2 is not supported: "
        "pipeline parallelism is not implemented; shard the model with --tensor-parallel-size",
    ),
    (["-pp", "2"], "--pipeline-parallel-size 2 is not supported"),
    (
        ["--data-parallel-size", "2"],
        "--data-parallel-size 2 is not supported: data "
        "parallelism is N `server` processes behind the SGLang gateway",
    ),
    (["--quantization", "awq"], "--quantization awq is not supported: quantized weights"),
    (
        ["--load-format", "gguf"],
        "--load-format gguf is not supported: checkpoints load with transformers",
    ),
    (
        ["--uvicorn-log-level", "debug"],
        "--uvicorn-log-level debug is not supported: this "
        "server speaks gRPC, not HTTP: use --log-level",
    ),
    (
        ["--enable-auto-tool-choice"],
        "--enable-auto-tool-choice is not supported: OpenAI "
        "HTTP, tool calls and reasoning are the SGLang gateway's",
    ),
    (["--tool-call-parser", "hermes"], "sglang-router with its --tool-call-parser"),
    (["--reasoning-parser", "qwen3"], "--reasoning-parser qwen3 is not supported"),
    (
        ["--cpu-offload-gb", "4"],
        "--cpu-offload-gb 4.0 is not supported: weights stay on the device; --kv-offload-memory",
    ),
    (
        ["--distributed-executor-backend", "ray"],
        "--distributed-executor-backend ray is not supported",
    ),
    (["--compilation-config", '{"level": 3}'], "the model runs eagerly"),
    (
        ["--hf-overrides", '{"rope_theta": 20000}'],
        '--hf-overrides {"rope_theta": 20000} is '
        "not supported: the model's config is read as the checkpoint has it",
    ),
    (
        ["--enable-expert-parallel"],
        "--enable-expert-parallel is not supported: expert parallelism is not implemented",
    ),
    (
        ["--tokenizer-mode", "slow"],
        "tokenizer_mode='slow' is not supported: tokenizers load with transformers' AutoTokenizer",
    ),
    (["--tokenizer-mode", "mistral"], "tokenizer_mode='mistral' is not supported"),
    (
        ["--limit-mm-per-prompt", '{"image": -1}'],
        "limit_mm_per_prompt.image must be an integer >= 0",
    ),
    (["--limit-mm-per-prompt", '{"smell": 1}'], "limit_mm_per_prompt: unknown modality"),
    (
        ["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "kafka"}'],
        "KV events stream over gRPC",
    ),
    (
        ["--swap-space", "4", "--kv-offload-memory", "1GiB"],
        "--swap-space and --kv-offload-memory name the same setting",
    ),
    (
        ["--download-dir", "/tmp/hub", "--worker", "127.0.0.1:1"],
        "--download-dir with --worker is not supported",
    ),
    (["a/model", "--model", "b/model"], "the model is given twice"),
    # vLLM's TLS flags are ours: the files are read (and here refused) as --tls-cert/--tls-key.
    (
        ["--ssl-certfile", "/nonexistent/c.pem", "--ssl-keyfile", "/nonexistent/k.pem"],
        "--tls-key: cannot read /nonexistent/k.pem",
    ),
    (["--ssl-certfile", "/nonexistent/c.pem"], "--tls-cert and --tls-key go together"),
    # Typos: one line with the closest flag, no usage dump; no prefix matching.
    (
        ["--max-num-seq", "4"],
        "unrecognized arguments: --max-num-seq (did you mean --max-num-seqs?)",
    ),
    (["--max-model", "64"], "(did you mean --max-model-len?)"),
    (["--swapspace", "4"], "(did you mean --swap-space?)"),
]


class _Settings:
    def __init__(self, argv: list[str]) -> None:
        ns = cli.build_parser().parse_args(argv)
        self.args = cli.engine_args_from(ns)
        self.sched = self.args.scheduler_config(128)
        self.cache = self.args.cache_config()
        cli.configure_logging(ns)
        self.metrics = cli.make_metrics(ns)
        self.metrics.close()


@pytest.fixture
def keep_log_level():
    logger = logging.getLogger("tokenbudget")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.mark.parametrize("argv, holds", SETTINGS, ids=[" ".join(a) for a, _ in SETTINGS])
def test_vllm_flag_reaches_its_setting(argv, holds, keep_log_level):
    assert holds(_Settings(argv))


@pytest.mark.parametrize("argv, reason", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_vllm_flag_is_refused_with_its_reason(argv, reason, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert reason in err and err.count("\n") == 1, err


def test_version_flag_prints_the_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("server (tokenbudget) ")


def test_llm_keywords_take_the_same_names_and_aliases():
    args = EngineArgs.from_kwargs(
        "m",
        num_gpu_blocks_override=40,
        kv_cache_memory_bytes="1GiB",
        scheduling_policy="priority",
        enable_prefix_caching=False,
        max_logprobs=5,
        preemption_mode="retract",
    )
    assert args.cache_config().num_blocks == 40
    assert args.cache_config().kv_cache_memory_bytes == 1 << 30
    assert args.scheduler_config(64).policy == "priority"
    assert args.scheduler_config(64).preemption_mode == "retract"
    assert args.cache_config().enable_prefix_caching is False
    with pytest.raises(
        ValueError, match="num_gpu_blocks_override and num_gpu_blocks name the same setting"
    ):
        EngineArgs.from_kwargs("m", num_gpu_blocks_override=40, num_gpu_blocks=41)
    with pytest.raises(TypeError, match="unknown engine argument 'max_num_seq'"):
        EngineArgs.from_kwargs("m", max_num_seq=4)
    with pytest.raises(ValueError, match="not supported"):
        EngineArgs.from_kwargs("m", kv_cache_dtype="fp8")
    assert EngineArgs.from_kwargs(
        "m", override_pooler_config={"normalize": False}
    ).pooler_config == {"normalize": False}


def test_llm_takes_speculative_config_as_a_dict_and_checks_it():
    args = EngineArgs.from_kwargs(
        "m",
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1},
    )
    sched = args.scheduler_config(64)
    assert (
        sched.num_speculative_tokens,
        sched.speculative_config.prompt_lookup_max,
        sched.async_scheduling,
    ) == (2, 1, True)
    with pytest.raises(ValueError, match="speculative_config.prompt_lookup_max must be >= 1"):
        EngineArgs.from_kwargs(
            "m",
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 1,
                "prompt_lookup_max": 0,
            },
        )
    with pytest.raises(TypeError, match="unknown engine argument 'num_speculative_tokens'"):
        EngineArgs.from_kwargs("m", num_speculative_tokens=2)


# Flags that act when the model loads, checked on one engine built with all of
# them (in process: loading once keeps this cheap).
@pytest.fixture(scope="module")
def flagged_engine(tiny_model, tmp_path_factory):
    from tokenbudget.server.testing.tiny_models import build_tokenizer

    tokenizer_dir = str(tmp_path_factory.mktemp("other_tokenizer"))
    build_tokenizer(tokenizer_dir)
    template_file = tmp_path_factory.mktemp("template") / "chat.jinja"
    template_file.write_text(TEMPLATE)
    ns = cli.build_parser().parse_args(
        [
            "--model",
            tiny_model,
            "--port",
            "0",
            "--num-gpu-blocks",
            "32",
            "--max-model-len",
            "256",
            "--served-model-name",
            "my-model",
            "--seed",
            "1234",
            "--tokenizer",
            tokenizer_dir,
            "--revision",
            "main",
            "--chat-template",
            str(template_file),
            "--generation-config",
            "vllm",
            "--max-logprobs",
            "3",
            "--kv-cache-dtype",
            "float32",
            "--pooler-config",
            '{"pooling_type": "cls", "normalize": false}',
            # Input limits (issue 10).
            "--max-image-pixels",
            "1000",
            "--max-image-pixels-per-request",
            "3000",
            "--max-prompt-bytes",
            "5000",
            "--grammar-cache-bytes",
            "123456",
            "--grammar-compile-timeout-s",
            "7",
            # Request string limits (issue 26).
            "--max-stop-strings",
            "11",
            "--max-stop-string-bytes",
            "12",
            "--max-bad-words",
            "13",
            "--max-bad-word-bytes",
            "14",
            "--max-structured-bytes",
            "15000",
        ]
    )
    engine = cli.build_engine(ns)
    yield engine, tokenizer_dir
    engine.shutdown()


def test_model_flags_reach_the_engine(flagged_engine):
    engine, tokenizer_dir = flagged_engine
    servicer = GenerationServicer(engine)
    assert servicer._model_info().model == "my-model"  # --served-model-name
    assert torch.initial_seed() == 1234  # --seed
    assert engine.input_processor.tokenizer.name_or_path == tokenizer_dir  # --tokenizer
    assert engine.input_processor.tokenizer.chat_template == TEMPLATE  # --chat-template FILE
    assert engine.sampling_defaults == {}  # --generation-config vllm
    assert engine.input_processor.max_logprobs == 3  # --max-logprobs
    assert engine.pooler_config == PoolerConfig("CLS", False)  # --pooler-config
    for field in ("logprobs", "prompt_logprobs"):
        request = generate_pb2.GenerateRequest(text="hi")
        setattr(request.sampling_params, field, 4)
        with pytest.raises(
            ValueError,
            match=f"sampling_params.{field} must be <= "
            r"max_logprobs \(3",
        ):
            servicer._make_requests(request)
    request = generate_pb2.GenerateRequest(text="hi")
    request.sampling_params.logprobs = 3
    servicer._make_requests(request)


def test_input_limit_flags_reach_the_engine(flagged_engine):
    engine, _ = flagged_engine
    processor = engine.input_processor
    assert (
        processor.max_image_pixels,
        processor.max_image_pixels_per_request,
        processor.max_prompt_bytes,
        processor.max_model_len,
    ) == (1000, 3000, 5000, 256)
    manager = engine.core.scheduler.structured_output_manager
    assert (manager.cache_bytes, manager.compile_timeout_s) == (123456, 7.0)
    assert processor.request_limits == RequestLimits(11, 12, 13, 14, 15000)
    with pytest.raises(ValueError, match=r"^stop: 12 entries, more than max_stop_strings=11"):
        processor.check_params(SamplingParams(stop=["s"] * 12))
    with pytest.raises(
        ValueError,
        match="prompt: the prompt is 5001 bytes, more than "
        "max_prompt_bytes=5000 .the server's limit",
    ):
        processor.process("x" * 5001)
    limits = EngineArgs.from_kwargs(
        "m",
        max_image_pixels=1000,
        max_prompt_bytes=5000,
        max_image_pixels_per_request=3000,
        limit_mm_per_prompt={"image": 3},
    ).input_limits(256)
    assert limits == {
        "max_model_len": 256,
        "max_prompt_bytes": 5000,
        "max_image_pixels": 1000,
        "max_image_pixels_per_request": 3000,
        "max_images_per_prompt": 3,
        "request_limits": RequestLimits(),
    }
    with pytest.raises(ValueError, match="max_image_pixels must be >= 1, got 0"):
        EngineArgs.from_kwargs("m", max_image_pixels=0)


def test_chat_template_may_be_given_inline(tiny_model):
    from tokenbudget.server.engine.input_processor import InputProcessor

    ns = cli.build_parser().parse_args(["--chat-template", TEMPLATE])
    template = cli.engine_args_from(ns).read_chat_template()
    processor = InputProcessor.from_pretrained(tiny_model, chat_template=template)
    ids, _ = processor.process({"messages": [{"role": "user", "content": "hi"}]})
    assert processor.tokenizer.decode(ids) == "<user>hi"


def test_kv_cache_dtype_other_than_the_models_is_refused_at_load(tiny_model):
    ns = cli.build_parser().parse_args(
        [
            "--model",
            tiny_model,
            "--port",
            "0",
            "--num-gpu-blocks",
            "8",
            "--kv-cache-dtype",
            "bfloat16",
        ]
    )
    with pytest.raises(
        ValueError,
        match="kv_cache_dtype='bfloat16' is not supported: the KV "
        r"cache is kept in the model's dtype \(float32\)",
    ):
        cli.build_engine(ns)


def test_tenant_and_slo_targets_reach_every_sample_request(flagged_engine):
    from tokenbudget.core import SamplingParams
    from tokenbudget.server.entrypoints.client import make_request

    servicer = GenerationServicer(flagged_engine[0])
    msg = make_request(
        "hi",
        SamplingParams(max_tokens=2, n=2),
        tenant="gold",
        ttft_ms=250.0,
        tpot_ms=40.0,
        cache_salt="s",
    )
    _, requests = servicer._make_requests(msg)
    assert [(r.tenant, r.ttft_ms, r.tpot_ms, r.cache_salt) for r in requests] == [
        ("gold", 250.0, 40.0, "s")
    ] * 2
    unset = servicer._make_requests(make_request("hi", SamplingParams()))[1][0]
    assert (unset.tenant, unset.ttft_ms, unset.tpot_ms, unset.cache_salt) == (None,) * 4
    with pytest.raises(ValueError, match="ttft_ms must be > 0, got -1.0"):
        servicer._make_requests(make_request("hi", SamplingParams(), ttft_ms=-1.0))


def test_download_dir_is_where_hub_models_are_found(tiny_model, tmp_path, monkeypatch):
    """vLLM's --download-dir: a hub id resolves in that folder's Hugging Face
    cache (offline here: the model is laid out there as a download would be);
    without the flag the same command cannot find it."""
    import shutil

    from tokenbudget.server.entrypoints.client import Client
    from tests.grpc.conftest import spawn_server

    revision = "0" * 40
    repo = tmp_path / "hub" / "models--tiny--qwen3"
    shutil.copytree(tiny_model, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    server = spawn_server(
        "download-dir",
        "tiny/qwen3",
        "--download-dir",
        str(tmp_path / "hub"),
        "--num-gpu-blocks",
        "32",
    ).wait_listening()
    try:
        with Client(server.address) as client:
            reply = client.generate(
                {"prompt_token_ids": [1, 2, 3]}, max_tokens=4, temperature=0.0, ignore_eos=True
            )
        assert len(reply.token_ids) == 4
    finally:
        server.stop()
    without = spawn_server("no-download-dir", "tiny/qwen3", "--num-gpu-blocks", "32")
    assert without.proc.wait(120) != 0
    without._ready.wait(10)  # its log is read to the end
    assert "tiny/qwen3" in "".join(without.log)

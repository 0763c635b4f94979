"""Embeddings through LLM.embed equal transformers' hidden states pooled the
same way: the base model's ``last_hidden_state`` (after the final norm) of
the tiny Qwen3 checkpoint, in float32 on CPU, within 1e-5 (absolute, per
component; the paged attention and the chunked float32 sums reorder
additions, nothing else differs).

Also: pooling across prefill chunks, in the same steps as greedy generation
(whose tokens still equal generate()), with a shared prefix already cached,
after preemption, and the default pooling a checkpoint declares."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenbudget.core import PoolingParams, SamplingParams
from tokenbudget.core.pooling_params import POOLING_TYPES, PoolerConfig
from tokenbudget.server import LLM
from tokenbudget.server.engine.pooler_defaults import load_pooler_config
from tokenbudget.server.engine.request_builder import build_pooling_request, build_requests
from tokenbudget.server.testing.tiny_models import add_sentence_transformers_files

ATOL = 1e-5
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_embed(hf_model):
    """The oracle: the base model's last hidden state, pooled."""

    def embed(prompt: list[int], pooling_type: str, normalize: bool) -> torch.Tensor:
        with torch.no_grad():
            hidden = hf_model.model(torch.tensor([prompt])).last_hidden_state[0].float()
        vec = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
        return torch.nn.functional.normalize(vec, dim=-1) if normalize else vec

    return embed


def make_llm(path, **kwargs) -> LLM:
    kwargs.setdefault("num_gpu_blocks", 128)
    return LLM(path, dtype="float32", device="cpu", **kwargs)


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


class StepLog:
    """Wraps the executor: per step, the scheduled token count of each request."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[dict[str, int]] = []
        inner = llm.engine.executor.execute_model

        def execute(so):
            self.steps.append(dict(so.num_scheduled_tokens))
            return inner(so)

        llm.engine.executor.execute_model = execute

    def chunks(self, request_id: str) -> list[int]:
        return [s[request_id] for s in self.steps if request_id in s]


def assert_close(got: list[float], want: torch.Tensor) -> None:
    got_t = torch.tensor(got)
    assert got_t.shape == want.shape
    err = (got_t - want).abs().max().item()
    assert err <= ATOL, f"max abs error {err:.3g} > {ATOL}"


@pytest.fixture(scope="module")
def chunky_llm(tiny_qwen3_path):
    """A 32-token budget and 24-token chunks: the 33..300-token prompts are
    pooled over 2 to 13 chunks."""
    return make_llm(tiny_qwen3_path, max_num_batched_tokens=32, long_prefill_token_threshold=24)


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "l2"])
@pytest.mark.parametrize("pooling_type", POOLING_TYPES)
def test_embeddings_equal_transformers_pooled_hidden_states(
    chunky_llm, prompts, hf_embed, pooling_type, normalize
):
    assert chunky_llm.engine.scheduler.reset_prefix_cache()  # LAST would hit the last run's
    log = StepLog(chunky_llm)
    params = PoolingParams(pooling_type, normalize)
    results = chunky_llm.embed(token_prompts(prompts), params)
    assert [r.prompt_token_ids for r in results] == prompts
    for r, p in zip(results, prompts):
        assert r.num_prompt_tokens == len(p)
        assert r.embedding is r.outputs.embedding
        assert_close(r.embedding, hf_embed(p, pooling_type, normalize))
        if normalize:
            assert abs(np.linalg.norm(r.embedding) - 1.0) < 1e-5
    # The long prompts really were pooled across chunks.
    assert max(len(log.chunks(r.request_id)) for r in results) >= 10


def test_default_pooling_is_last_token_normalised_for_a_decoder(chunky_llm, prompts, hf_embed):
    assert chunky_llm.pooler_config == PoolerConfig("LAST", True)
    (result,) = chunky_llm.embed({"prompt_token_ids": prompts[4]})
    assert_close(result.embedding, hf_embed(prompts[4], "LAST", True))


NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


@pytest.mark.parametrize(
    "engine_args",
    [
        {"async_scheduling": False},
        {"async_scheduling": True},
        {"async_scheduling": False, "speculative_config": NGRAM},  # drafts beside pooling
    ],
    ids=["sync", "async", "ngram-drafts"],
)
def test_embeddings_share_steps_with_greedy_generation(
    tiny_qwen3_path, prompts, hf_embed, hf_greedy, engine_args
):
    llm = make_llm(tiny_qwen3_path, max_num_batched_tokens=48, **engine_args)
    log = StepLog(llm)
    gen_prompts, emb_prompts = prompts[2:5], prompts[3:8]
    engine = llm.engine
    gen = [
        build_requests(llm.input_processor, f"gen-{i}", {"prompt_token_ids": p}, GREEDY)[0]
        for i, p in enumerate(gen_prompts)
    ]
    kinds = ["MEAN", "LAST", "CLS", "MEAN", "LAST"]
    emb = [
        build_pooling_request(
            llm.input_processor,
            f"emb-{i}",
            {"prompt_token_ids": p},
            PoolingParams(kind, i % 2 == 0),
            llm.pooler_config,
        )
        for i, (p, kind) in enumerate(zip(emb_prompts, kinds))
    ]
    for a, b in zip(gen + [None] * 2, emb):  # interleaved arrivals
        if a is not None:
            engine.add_request(a)
        engine.add_request(b)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in gen}
    vectors, finish = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in tokens:
                tokens[out.request_id] += out.new_token_ids
            else:
                assert out.new_token_ids == []  # a pooling request samples nothing
                if out.finished:
                    vectors[out.request_id] = out.pooling_output
                    finish[out.request_id] = out.finish_reason
    assert [tokens[r.request_id] for r in gen] == [hf_greedy(p, 12) for p in gen_prompts]
    for i, (p, kind) in enumerate(zip(emb_prompts, kinds)):
        assert finish[f"emb-{i}"] == "stop"
        assert_close(vectors[f"emb-{i}"].tolist(), hf_embed(p, kind, i % 2 == 0))
    # Some step computed a pooling chunk next to a generation request's decode.
    decodes_with_pooling = [
        s
        for s in log.steps
        if any(k.startswith("emb") for k in s)
        and any(k.startswith("gen") and n == 1 for k, n in s.items())
    ]
    assert decodes_with_pooling
    if "speculative_config" in engine_args:  # drafts were verified while pooling ran
        assert llm.engine.scheduler.make_stats().spec_decoding.num_draft_tokens > 0
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1  # nothing leaked


def test_shared_prefix_in_cache(tiny_qwen3_path, prompts, hf_embed):
    """A generation request caches a 96-token prefix first. LAST pooling reads
    the cache (only its last token must be computed); MEAN and CLS skip
    reading it (the hidden states of cached tokens are not kept), and all
    three still equal the oracle."""
    llm = make_llm(tiny_qwen3_path)
    prefix = prompts[7][:96]
    llm.generate({"prompt_token_ids": prefix + prompts[1]}, GREEDY)
    queries = {kind: prefix + prompts[i] for i, kind in zip((2, 3, 4), POOLING_TYPES)}
    for kind, p in queries.items():
        (result,) = llm.embed({"prompt_token_ids": p}, PoolingParams(kind, False))
        assert result.num_cached_tokens == (96 if kind == "LAST" else 0), kind
        assert_close(result.embedding, hf_embed(p, kind, False))


def test_preempted_embedding_recomputes_its_prompt(tiny_qwen3_path, prompts, hf_embed, hf_greedy):
    """Nine blocks of 16: two generation requests grow into the blocks a
    chunked MEAN embedding holds, so it is preempted mid-prefill (or they
    are) and recomputed from position 0; its sums restart there."""
    llm = make_llm(
        tiny_qwen3_path,
        num_gpu_blocks=10,
        max_num_batched_tokens=24,
        async_scheduling=False,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    long_gen = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    gen = [
        build_requests(llm.input_processor, f"gen-{i}", {"prompt_token_ids": p}, long_gen)[0]
        for i, p in enumerate(prompts[2:4])
    ]
    emb = build_pooling_request(
        llm.input_processor,
        "emb",
        {"prompt_token_ids": prompts[5]},
        PoolingParams("MEAN", False),
        llm.pooler_config,
    )
    for r in (*gen, emb):
        engine.add_request(r)
    tokens = {r.request_id: [] for r in gen}
    vector = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "emb":
                vector = out.pooling_output if out.finished else vector
            else:
                tokens[out.request_id] += out.new_token_ids
    assert engine.scheduler.make_stats().num_preemptions > 0
    assert_close(vector.tolist(), hf_embed(prompts[5], "MEAN", False))
    assert [tokens[r.request_id] for r in gen] == [hf_greedy(p, 40) for p in prompts[2:4]]


# -- the model's default pooling --------------------------------------------------------------


@pytest.mark.parametrize(
    "mode,normalize,expected",
    [
        ("mean", False, PoolerConfig("MEAN", False)),
        ("cls", True, PoolerConfig("CLS", True)),
        ("lasttoken", True, PoolerConfig("LAST", True)),
    ],
)
def test_sentence_transformers_files_choose_the_default(tmp_path, mode, normalize, expected):
    add_sentence_transformers_files(tmp_path, mode, normalize)
    assert load_pooler_config(str(tmp_path)) == expected


def test_pooler_config_setting_overrides_the_checkpoint_field_by_field(tmp_path):
    add_sentence_transformers_files(tmp_path, "mean", False)
    assert load_pooler_config(str(tmp_path), '{"normalize": true}') == PoolerConfig("MEAN", True)
    assert load_pooler_config(str(tmp_path), {"pooling_type": "cls"}) == PoolerConfig("CLS", False)
    assert load_pooler_config(str(tmp_path / "none")) == PoolerConfig("LAST", True)


def test_checkpoint_default_reaches_llm_embed(tiny_qwen3_path, tmp_path, prompts, hf_embed):
    import shutil

    folder = tmp_path / "st"
    shutil.copytree(tiny_qwen3_path, folder)
    add_sentence_transformers_files(folder, "mean", False)
    llm = make_llm(str(folder))
    (default,) = llm.embed({"prompt_token_ids": prompts[3]})
    assert_close(default.embedding, hf_embed(prompts[3], "MEAN", False))
    (override,) = llm.embed({"prompt_token_ids": prompts[3]}, PoolingParams(normalize=True))
    assert_close(override.embedding, hf_embed(prompts[3], "MEAN", True))


# -- bad options --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"pooling_type": "MAX"}, "pooling_type"),
        ({"pooling_type": 3}, "pooling_type"),
        ({"normalize": "yes"}, "normalize"),
        ({"normalize": 1}, "normalize"),
    ],
)
def test_bad_pooling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        PoolingParams(**kwargs)


@pytest.mark.parametrize(
    "value,message",
    [
        ('{"pooling_type": "ALL"}', "pooler_config.pooling_type must be one of LAST, MEAN, CLS"),
        ('{"normalize": "no"}', "pooler_config.normalize must be true or false"),
        ('{"dimensions": 8}', r"pooler_config.dimensions: not supported"),
        ("MEAN", "pooler_config: not JSON"),
        ("[1]", "pooler_config must be a JSON object"),
    ],
)
def test_bad_pooler_config_is_refused_before_loading(value, message):
    with pytest.raises(ValueError, match=message):
        LLM("/nonexistent/model", pooler_config=value)


def test_embed_refuses_sampling_params_in_place_of_pooling_params(chunky_llm):
    with pytest.raises(ValueError, match="pooling_params must be a PoolingParams"):
        chunky_llm.embed("hello", SamplingParams())
    with pytest.raises(ValueError, match="pooling_params: got 2 for 1 prompts"):
        chunky_llm.embed("hello", [PoolingParams(), PoolingParams()])


# -- vision-language models -------------------------------------------------------------------


def test_vl_embedding_with_an_image_across_chunks(tmp_path, vl_chats):
    """A chat with two images, pooled in 16-token chunks that cut through the
    images, equals the transformers VL model's last hidden state pooled
    (Qwen3-VL: its deepstack features enter the decoder too)."""
    from transformers import AutoModelForImageTextToText

    from tokenbudget.server.engine.mm_processor import MultiModalProcessor
    from tokenbudget.server.testing import tiny_vl_models
    from tokenbudget.worker.vision import mm_token_type_ids

    path = tiny_vl_models.build_tiny_qwen3_vl(tmp_path)
    chat = vl_chats[0]
    ids, features = MultiModalProcessor.from_pretrained(path).process_messages(chat)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model.model(
            input_ids=torch.tensor([ids]),
            pixel_values=torch.cat([f.data["pixel_values"] for f in features]),
            image_grid_thw=torch.cat([f.data["image_grid_thw"] for f in features]),
            mm_token_type_ids=mm_token_type_ids(len(ids), features),
        ).last_hidden_state[0]
    llm = make_llm(path, num_gpu_blocks=64, max_num_batched_tokens=16)
    log = StepLog(llm)
    for kind, want in (("MEAN", hidden.mean(0)), ("LAST", hidden[-1])):
        (result,) = llm.embed({"messages": chat}, PoolingParams(kind, False))
        assert result.prompt_token_ids == ids
        assert_close(result.embedding, want)
        if kind == "MEAN":  # (LAST then finds the prompt in the prefix cache)
            assert len(log.chunks(result.request_id)) > 1

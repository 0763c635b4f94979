"""LoRA adapters over gRPC: GenerateRequest.lora_name selects one (tokens
equal PeftModel.generate), GetModelInfo lists them, LoadLoRAAdapter /
UnloadLoRAAdapter change them at run time, and bad names or folders are
refused naming them while the server keeps serving."""

from __future__ import annotations

import json
import shutil

import grpc
import pytest
import torch

from tokenbudget.core import SamplingParams

peft = pytest.importorskip("peft")

PROMPT = list(range(40, 90))
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _base(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _save_adapter(base_path, folder, rank, seed) -> str:
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False,  # random B: the adapter changes the outputs
    )
    model = peft.get_peft_model(_base(base_path), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(2.0)
    model.save_pretrained(folder)
    return str(folder)


def _peft_tokens(base_path, folder) -> list[int]:
    model = peft.PeftModel.from_pretrained(_base(base_path), folder).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=10, min_new_tokens=10, do_sample=False
        )
    return out[0, len(PROMPT) :].tolist()


@pytest.fixture(scope="module")
def served(tiny_qwen3_path, tmp_path_factory, serving):
    from tokenbudget.server.engine.args import EngineArgs
    from tokenbudget.server.engine.factory import build_async_engine

    root = tmp_path_factory.mktemp("grpc-loras")
    folders = {
        n: _save_adapter(tiny_qwen3_path, root / n, r, s)
        for n, r, s in [("sql", 4, 1), ("chat", 8, 2)]
    }
    expected = {n: _peft_tokens(tiny_qwen3_path, f) for n, f in folders.items()}
    args = EngineArgs.from_kwargs(
        tiny_qwen3_path,
        dtype="float32",
        device="cpu",
        num_gpu_blocks=64,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        lora_modules=[f"sql={folders['sql']}"],
    )
    engine = build_async_engine(args)
    with serving(engine) as client:
        yield client, folders, expected, root, engine


def _refused(call, code=grpc.StatusCode.INVALID_ARGUMENT) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code
    assert "\n" not in err.value.details()
    return err.value.details()


def test_adapter_by_name_equals_peft_and_the_base_equals_transformers(served, hf_model):
    client, _, expected, _, _ = served
    assert client.list_models()[1:] == ["sql"]
    got = client.generate({"prompt_token_ids": PROMPT}, PARAMS, lora_name="sql").token_ids
    assert got == expected["sql"]
    base = client.generate({"prompt_token_ids": PROMPT}, PARAMS).token_ids
    oracle = hf_model.generate(
        torch.tensor([PROMPT]), max_new_tokens=10, min_new_tokens=10, do_sample=False
    )
    assert base == oracle[0, len(PROMPT) :].tolist() != expected["sql"]


def test_load_and_unload_at_run_time(served):
    client, folders, expected, _, _ = served

    def generate(name):
        return client.generate({"prompt_token_ids": PROMPT}, PARAMS, lora_name=name)

    assert "unknown LoRA adapter 'chat'" in _refused(lambda: generate("chat"))
    lora_id = client.load_lora_adapter("chat", folders["chat"])
    assert lora_id >= 2 and client.list_models()[1:] == ["sql", "chat"]
    assert generate("chat").token_ids == expected["chat"]
    # A running request keeps its adapter after the name is unloaded.
    stream = client.generate_stream(
        {"prompt_token_ids": PROMPT}, PARAMS, lora_name="chat", request_id="long"
    )
    first = next(stream)
    client.unload_lora_adapter("chat")
    tokens = list(first.token_ids) + [t for m in stream for t in m.token_ids]
    assert tokens == expected["chat"]
    assert "unknown LoRA adapter 'chat'" in _refused(lambda: generate("chat"))
    assert "'ghost'" in _refused(
        lambda: client.unload_lora_adapter("ghost"), grpc.StatusCode.NOT_FOUND
    )
    assert generate("sql").token_ids == expected["sql"]  # still serving


def test_bad_adapters_are_refused_naming_them(served):
    client, folders, _, root, _ = served
    wide = root / "wide"
    shutil.copytree(folders["chat"], wide)
    config = json.loads((wide / "adapter_config.json").read_text())
    (wide / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    assert "'wide': rank 64 is above max_lora_rank=8" in _refused(
        lambda: client.load_lora_adapter("wide", str(wide))
    )
    assert "'gone': no adapter_config.json" in _refused(
        lambda: client.load_lora_adapter("gone", str(root / "nothing-here"))
    )
    assert "already loaded" in _refused(lambda: client.load_lora_adapter("sql", folders["sql"]))
    assert client.list_models()[1:] == ["sql"]


def test_the_gateway_protocols_lora_id_names_an_adapter(served):
    from tokenbudget.proto import sglang_scheduler_pb2 as sg
    from tokenbudget.server.entrypoints.grpc.sglang import SglangSchedulerServicer

    engine = served[4]
    servicer = SglangSchedulerServicer(engine)
    added = []

    class Admission:  # records what the servicer queues
        def add_request(self, requests, **kwargs):
            added.extend(requests)
            return None

    def submit(lora_id):
        request = sg.GenerateRequest(
            request_id=f"gw-{lora_id}",
            tokenized=sg.TokenizedInput(input_ids=PROMPT),
            sampling_params=sg.SamplingParams(
                max_new_tokens=2, temperature=1.0, top_p=1.0, repetition_penalty=1.0
            ),
            lora_id=lora_id,
        )
        servicer._submit(request, Admission())

    submit("sql")
    assert added[-1].lora_request == engine.loras.resolve("sql")
    with pytest.raises(ValueError, match="lora_id: unknown LoRA adapter 'nope'"):
        submit("nope")


def test_a_remote_worker_serves_adapters_as_the_engine_in_process_does(
    served, tiny_qwen3_path, serving
):
    """``--worker``: the LoRA settings reach the worker in Initialize and each
    request's adapter (name, id, folder) travels with it in the step stream;
    base and two adapters of different ranks, in one batch, give the tokens
    of the engine in process (and of PEFT)."""
    import gc
    from concurrent.futures import ThreadPoolExecutor

    from tokenbudget.server.engine.args import EngineArgs
    from tokenbudget.server.engine.factory import Placement, build_async_engine
    from tokenbudget.worker.grpc_worker import serve

    local, folders, expected, _, _ = served
    want = {n: expected[n] for n in ("sql", "chat")}
    want[None] = local.generate({"prompt_token_ids": PROMPT}, PARAMS).token_ids
    thresholds = gc.get_threshold()
    server, port, _ = serve("127.0.0.1", 0)
    args = EngineArgs.from_kwargs(
        tiny_qwen3_path,
        dtype="float32",
        device="cpu",
        num_gpu_blocks=64,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        lora_modules=[f"{name}={folder}" for name, folder in folders.items()],
    )
    placement = Placement((f"127.0.0.1:{port}",), None, 64 << 20, 60.0, 0.0, None)
    try:
        with (
            serving(build_async_engine(args, placement=placement)) as client,
            ThreadPoolExecutor(3) as pool,
        ):
            got = dict(
                zip(
                    want,
                    pool.map(
                        lambda n: (
                            client.generate(
                                {"prompt_token_ids": PROMPT}, PARAMS, lora_name=n
                            ).token_ids
                        ),
                        want,
                    ),
                )
            )
    finally:
        server.stop(0)
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    assert got == want
    assert len({tuple(t) for t in got.values()}) == 3  # each adapter moved the tokens

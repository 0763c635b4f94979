"""Multi-LoRA serving against PEFT: adapters saved with
``peft.get_peft_model(...).save_pretrained`` on the tiny Qwen3, served
together in one batch (base requests beside them), give the greedy tokens
``PeftModel.generate()`` gives for each adapter alone; bad adapters are
refused in one line naming them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tokenbudget.core import LoRARequest, SamplingParams
from tokenbudget.server import LLM
from tokenbudget.worker import lora_layers
from tokenbudget.worker.lora import NO_LORA
from tokenbudget.worker.lora_layers import LoRALayer

peft = pytest.importorskip("peft")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, lora_alpha, use_rslora, target modules): three ranks, both scalings.
ADAPTERS = {
    "r4": (4, 8, False, ["q_proj", "v_proj"]),
    "r8": (8, 16, True, ALL),
    "r16": (16, 8, False, ["o_proj", "gate_proj", "up_proj", "down_proj", "k_proj"]),
}


def _base(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


def save_adapter(base_path, folder, rank, alpha, rslora, targets, seed):
    """A PEFT adapter with random (non-zero) A and B, saved by PEFT itself."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        use_rslora=rslora,
        target_modules=targets,
        init_lora_weights=False,  # B random too: the adapter changes the outputs
    )
    model = peft.get_peft_model(_base(base_path), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(2.0)  # large enough to move greedy tokens of a random model
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def adapters(tiny_qwen3_path, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("loras")
    return {
        name: LoRARequest(name, i + 1, save_adapter(tiny_qwen3_path, root / name, *spec, seed=i))
        for i, (name, spec) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def peft_greedy(tiny_qwen3_path, adapters, prompts):
    """The oracle: PeftModel.generate per adapter (None: transformers, no adapter)."""

    def run(model, prompt):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False
            )
        return out[0, len(prompt) :].tolist()

    expected = {None: [run(_base(tiny_qwen3_path), p) for p in prompts]}
    for name, lora in adapters.items():
        model = peft.PeftModel.from_pretrained(_base(tiny_qwen3_path), lora.lora_path).eval()
        expected[name] = [run(model, p) for p in prompts]
    return expected


def make_llm(path, **kwargs) -> LLM:
    kwargs.setdefault("num_gpu_blocks", 256)
    return LLM(path, dtype="float32", device="cpu", enable_lora=True, **kwargs)


def test_adapters_change_the_outputs(peft_greedy):
    for name in ADAPTERS:
        assert peft_greedy[name] != peft_greedy[None], name


@pytest.mark.parametrize(
    "engine_args",
    [
        {"max_loras": 4, "max_num_batched_tokens": 64, "async_scheduling": False},
        {"max_loras": 2, "max_cpu_loras": 2, "max_num_batched_tokens": 96},
        {"max_loras": 3, "num_gpu_blocks": 40, "max_num_batched_tokens": 128},
    ],
    ids=["chunked-prefill-4-slots", "async-2-slots", "async-preempting-3-slots"],
)
@pytest.mark.parametrize("form", ["dense", "grouped"])
def test_mixed_batch_equals_peft_generate_per_adapter(
    tiny_qwen3_path, adapters, prompts, peft_greedy, engine_args, form, monkeypatch
):
    if form == "grouped":  # every step in the grouped form (worker/lora_layers.py)
        monkeypatch.setattr(lora_layers, "DENSE_MAX_ELEMENTS", 0)
    forms = set()
    real_set = lora_layers.LoRAStep.set

    def spy(self, *args):
        real_set(self, *args)
        forms.add("dense" if self.mask is not None else self.order is not None and "grouped")

    monkeypatch.setattr(lora_layers.LoRAStep, "set", spy)
    llm = make_llm(tiny_qwen3_path, max_lora_rank=16, **engine_args)
    names = [None, "r4", "r8", "r16"]
    # Every prompt under every adapter and the base, interleaved in one batch.
    cases = [(names[(i + j) % 4], i) for j in range(2) for i in range(len(prompts))]
    results = llm.generate(
        [{"prompt_token_ids": prompts[i]} for _, i in cases],
        GREEDY,
        lora_request=[None if n is None else adapters[n] for n, _ in cases],
    )
    got = [r.token_ids for r in results]
    assert got == [peft_greedy[n][i] for n, i in cases]
    assert form in forms and len(forms - {False}) == 1
    # With fewer slots than adapters, an adapter waited for one to free its slot.
    assert llm.engine.executor.worker.model_runner.lora.num_slot_loads >= 3
    if engine_args.get("num_gpu_blocks") == 40:
        assert llm.engine.scheduler.num_preemptions > 0


def test_device_slots_are_refilled_least_recently_used_first_sparing_the_step(
    tiny_qwen3_path, adapters
):
    import numpy as np

    from tokenbudget.core import LoRAConfig, NewRequestData, SchedulerOutput
    from tokenbudget.core.outputs import CachedRequestData
    from tokenbudget.worker.lora import LoRAManager

    manager = LoRAManager(
        _base(tiny_qwen3_path),
        LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=16),
        torch.device("cpu"),
        torch.float32,
    )
    new = [
        NewRequestData(rid, [1], [], GREEDY, [], 0, lora_request=adapters[name])
        for rid, name in (("a", "r4"), ("b", "r8"), ("c", "r16"))
    ]
    assert manager.update(SchedulerOutput(new, CachedRequestData(), {}, 0)) == {}

    def step(*req_ids):
        manager.prepare(list(req_ids), np.ones(len(req_ids), np.int64))
        return dict(manager.slots)  # adapter id -> device slot

    assert step("a", "b") == {1: 1, 2: 2}
    assert step("c", "a") == {1: 1, 3: 2}  # r8 (least recently used) made room
    assert step("b") == {3: 2, 2: 1}  # now r4 was; r16 stays
    assert manager.num_slot_loads == 4


def test_one_lora_request_for_all_prompts_and_lora_runs_eager(
    tiny_qwen3_path, adapters, prompts, peft_greedy
):
    # The compiled decoder does not follow the per-step regrouping: LoRA runs eager.
    llm = make_llm(tiny_qwen3_path, max_lora_rank=16, async_scheduling=False, enforce_eager=False)
    assert llm.engine.executor.worker.model_runner.compiled is None
    results = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:3]], GREEDY, lora_request=adapters["r8"]
    )
    assert [r.token_ids for r in results] == peft_greedy["r8"][:3]


def test_prefix_cache_hits_only_within_one_adapter(tiny_qwen3_path, adapters, prompts, peft_greedy):
    llm = make_llm(tiny_qwen3_path, max_loras=2, num_gpu_blocks=64, async_scheduling=False)
    prompt = {"prompt_token_ids": prompts[5]}  # 100 tokens: 6 full blocks

    def generate(name):
        (result,) = llm.generate(prompt, GREEDY, lora_request=name and adapters[name])
        assert result.token_ids == peft_greedy[name][5]
        return result.num_cached_tokens

    assert generate("r4") == 0
    assert generate("r8") == 0  # the same prompt under another adapter
    assert generate(None) == 0  # the base model
    assert generate("r4") == 96  # the same adapter: its full blocks
    assert generate(None) == 96


def test_lora_off_leaves_the_model_untouched(tiny_qwen3_path):
    llm = LLM(tiny_qwen3_path, dtype="float32", device="cpu", num_gpu_blocks=64)
    runner = llm.engine.executor.worker.model_runner
    hooks = [h for m in runner.model.modules() for h in m._forward_hooks.values()]
    assert runner.lora is NO_LORA and not any(isinstance(h, LoRALayer) for h in hooks)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("x", 1, "/nowhere"))


def _copy(adapter: LoRARequest, folder) -> str:
    shutil.copytree(adapter.lora_path, folder)
    return str(folder)


def _edit_config(folder, **changes) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_bad_adapters_are_refused_in_one_line_naming_them(tiny_qwen3_path, adapters, tmp_path):
    llm = make_llm(tiny_qwen3_path, max_lora_rank=8, num_gpu_blocks=64)
    bad = {}
    bad["too-big"] = (adapters["r16"].lora_path, "rank 16 is above max_lora_rank=8")
    bad["missing"] = (str(tmp_path / "nothing"), "no adapter_config.json")
    corrupt = tmp_path / "corrupt"
    _copy(adapters["r4"], corrupt)
    (corrupt / "adapter_config.json").write_text("{not json")
    bad["corrupt"] = (str(corrupt), "unreadable")
    target = tmp_path / "target"
    _copy(adapters["r4"], target)
    _edit_config(target, target_modules=["q_proj", "lm_head"])
    bad["target"] = (str(target), "unsupported target module(s) lm_head")
    dora = tmp_path / "dora"
    _copy(adapters["r4"], dora)
    _edit_config(dora, use_dora=True)
    bad["dora"] = (str(dora), "DoRA")
    for i, (name, (path, reason)) in enumerate(bad.items()):
        with pytest.raises(ValueError) as info:
            llm.generate("hello", GREEDY, lora_request=LoRARequest(name, 10 + i, path))
        message = str(info.value)
        assert "\n" not in message and f"LoRA adapter {name!r}" in message and reason in message
    # The engine keeps serving.
    assert llm.generate("hello", GREEDY)[0].finish_reason == "length"


def test_weights_that_do_not_fit_the_model_fail_only_their_request(
    tiny_qwen3_path, adapters, tmp_path, peft_greedy, prompts
):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    _copy(adapters["r4"], broken)
    tensors = load_file(broken / "adapter_model.safetensors")
    key = next(iter(tensors))
    tensors[key.replace("layers.0.", "layers.99.")] = tensors.pop(key)
    save_file(tensors, broken / "adapter_model.safetensors")
    llm = make_llm(tiny_qwen3_path, num_gpu_blocks=64, async_scheduling=False)
    results = llm.generate(
        [{"prompt_token_ids": prompts[0]}] * 2,
        GREEDY,
        lora_request=[LoRARequest("broken", 7, str(broken)), adapters["r4"]],
    )
    assert results[0].outputs[0].finish_reason == "error"
    assert "LoRA adapter 'broken'" in results[0].outputs[0].error
    assert "layers.99" in results[0].outputs[0].error
    assert results[1].token_ids == peft_greedy["r4"][0]


def test_tensor_parallel_ranks_shard_adapters_like_their_base_weights(
    tiny_qwen3_path, adapters, prompts, peft_greedy
):
    """TP=2 (two rank processes, gloo on CPU): B of the column-parallel
    layers and A of the row-parallel ones (o_proj, down_proj) are cut like
    the base weights, the row layers' partial deltas summed by their
    all-reduce; a mixed batch (base, rank 8 on every projection, rank 16)
    gives TP=1's greedy tokens, which are PEFT's."""
    names = [None, "r8", "r16"]
    cases = [(names[i % 3], i) for i in range(4)]
    inputs = [{"prompt_token_ids": prompts[i]} for _, i in cases]
    loras = [None if n is None else adapters[n] for n, _ in cases]
    got = {}
    for tp in (1, 2):
        llm = make_llm(tiny_qwen3_path, max_loras=2, max_lora_rank=16, tensor_parallel_size=tp)
        try:
            got[tp] = [r.token_ids for r in llm.generate(inputs, GREEDY, lora_request=loras)]
        finally:
            llm.shutdown()
    assert got[2] == got[1] == [peft_greedy[n][i] for n, i in cases]

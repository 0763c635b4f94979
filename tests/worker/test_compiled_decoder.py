"""The compiled decoder (worker/compiled.py): greedy tokens equal transformers
generate() through chunked prefill, mixed batches and prefix-cache hits; one
trace serves steps of every token count and batch size (no recompiles); and
enforce_eager keeps the model eager."""

from __future__ import annotations

import pytest
import torch

from tokenbudget.core import SamplingParams
from tokenbudget.server import LLM
from tokenbudget.worker.attention import PAGED_ATTENTION
from tokenbudget.worker.compiled import PAGED_ATTENTION_OP, paged_attention_op

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def runner_of(llm: LLM):
    return llm.engine.executor.worker.model_runner


@pytest.fixture(scope="module")
def compiled_llm(tiny_qwen3_path):
    # sdpa here; the oracle test (test_llm_matches_transformers) runs the
    # compiled decoder on the default backend.
    llm = LLM(
        tiny_qwen3_path,
        dtype="float32",
        device="cpu",
        enforce_eager=False,
        attention_backend="sdpa",
        max_num_batched_tokens=64,
        num_gpu_blocks=256,
        async_scheduling=False,
    )
    yield llm
    llm.shutdown()


class StepShapes:
    """Wraps the decoder's compiled function, recording each step's (tokens, kept rows)."""

    def __init__(self, decoder) -> None:
        self.shapes: list[tuple[int, int]] = []
        inner = decoder._fn

        def fn(input_ids, positions, keep):
            self.shapes.append((input_ids.shape[0], keep.shape[0]))
            return inner(input_ids, positions, keep)

        decoder._fn = fn


def test_one_trace_serves_chunks_decodes_and_prefix_hits(
    compiled_llm, prompts, hf_greedy_16, hf_greedy
):
    decoder = runner_of(compiled_llm).compiled
    # Compiled by the start-up warm-up (or found compiled: engines of one
    # architecture in one process share the trace).
    assert decoder is not None and decoder.num_calls == 1 and decoder.num_compiles <= 1
    compiles = decoder.num_compiles
    decoder.guarded_calls = 10**9  # dynamo's guards on, so a step that needs a new trace makes one
    steps = StepShapes(decoder)
    results = compiled_llm.generate(token_prompts(prompts), GREEDY)
    assert [r.token_ids for r in results] == hf_greedy_16
    again = compiled_llm.generate(token_prompts(prompts[-2:]), GREEDY)
    assert [r.num_cached_tokens for r in again] == [(len(p) - 1) // 16 * 16 for p in prompts[-2:]]
    assert [r.token_ids for r in again] == hf_greedy_16[-2:]
    # Alone, a new 180-token prompt: chunks that sample nothing, then lone decodes.
    new = prompts[6][::-1]
    alone = compiled_llm.generate(
        token_prompts([new]), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )
    assert alone[0].num_cached_tokens == 0
    assert alone[0].token_ids == hf_greedy(new, 24)
    tokens = {t for t, _ in steps.shapes}
    kept = {k for _, k in steps.shapes}
    # Chunks of the 64-token budget (some keeping no logits row), mixed
    # steps, decode batches and a lone decode (1 token) all ran ...
    assert 64 in tokens and 1 in tokens and len(tokens) >= 6
    assert 0 in kept and 1 in kept and len(kept) >= 4
    # ... through the trace compiled at start-up.
    assert decoder.num_compiles == compiles
    decoder.guarded_calls = 2  # unguarded again (what every engine does after 2 calls) ...
    again = compiled_llm.generate(token_prompts(prompts), GREEDY)
    assert [r.token_ids for r in again] == hf_greedy_16  # ... gives the same tokens


def test_pooling_steps_run_eagerly_beside_the_compiled_decoder(compiled_llm, prompts, hf_model):
    """The runner's eager forward (pooling) passes the metadata itself; the
    op's attention entry point then runs the paged attention directly."""
    model = runner_of(compiled_llm).model
    assert model.config.get_text_config()._attn_implementation == PAGED_ATTENTION_OP
    (result,) = compiled_llm.embed({"prompt_token_ids": prompts[4]})
    with torch.no_grad():
        last = hf_model.model(torch.tensor([prompts[4]])).last_hidden_state[0, -1]
    want = torch.nn.functional.normalize(last, dim=-1)
    torch.testing.assert_close(torch.tensor(result.embedding), want, rtol=0, atol=1e-5)
    # Generation goes on through the trace compiled at start-up.
    assert runner_of(compiled_llm).compiled.num_compiles <= 1


def test_attention_op_outside_a_forward_context_is_refused():
    q = torch.zeros(1, 4, 2, 8)
    k = v = torch.zeros(1, 2, 2, 8)
    with pytest.raises(RuntimeError, match="forward_context"):
        paged_attention_op(q, k, v, 0, 1.0, 0)


@pytest.mark.parametrize("enforce_eager", [True, None], ids=["enforce-eager", "cpu-default"])
def test_enforce_eager_keeps_the_model_eager(tiny_qwen3_path, prompts, hf_greedy_16, enforce_eager):
    from torch._dynamo.utils import counters

    kwargs = {} if enforce_eager is None else {"enforce_eager": enforce_eager}
    llm = LLM(tiny_qwen3_path, dtype="float32", device="cpu", num_gpu_blocks=256, **kwargs)
    runner = runner_of(llm)
    assert runner.enforce_eager is True and runner.compiled is None
    assert runner.model.config.get_text_config()._attn_implementation == PAGED_ATTENTION
    frames = sum(counters["frames"].values())
    results = llm.generate(token_prompts(prompts[:3]), GREEDY)
    assert [r.token_ids for r in results] == hf_greedy_16[:3]
    assert sum(counters["frames"].values()) == frames  # dynamo saw no frame
    llm.shutdown()


def test_a_failed_compile_falls_back_to_the_eager_model(tiny_qwen3_path, monkeypatch, caplog):
    from types import SimpleNamespace

    from tokenbudget.worker.compiled import CompiledDecoder, compile_decoder
    from tokenbudget.worker.loader import load_model

    model = load_model(tiny_qwen3_path, dtype="float32", device="cpu")
    runner = SimpleNamespace(
        enforce_eager=False,
        vision=None,
        parallel=None,
        model=model,
        attention_backend="sdpa",
        device=torch.device("cpu"),
    )
    runner.kv_caches, runner.block_size = [], 16

    def no_compiler(self, *args):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(CompiledDecoder, "warm_up", no_compiler)
    assert compile_decoder(runner) is None
    assert model.config.get_text_config()._attn_implementation == PAGED_ATTENTION
    assert "compiling failed: InvalidCxxCompiler" in caplog.text

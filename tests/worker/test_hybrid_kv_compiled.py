"""The compiled decoder (worker/compiled.py) runs models with KV cache groups:
greedy tokens equal transformers generate(), and their logprobs its
log-softmax, for tiny Gemma-2 (attention soft-capping that changes the
scores, alternating sliding / full layers) and Mistral with a window
narrower than the prompt, through chunked prefill, prompts several windows
long and prefix hits, on one trace (a single compile per engine)."""

from __future__ import annotations

import pytest
import torch

from tokenbudget.core import SamplingParams
from tokenbudget.server import LLM

from .test_hybrid_kv import BS, COMMON, NEW, WINDOW, _build, _expected, _prompts


def _build_capped_gemma2(tmp_path) -> str:
    """Gemma-2 with weights large enough that its attention soft-cap (1.0)
    moves every logprob (by up to ~5 nats here): skipping it cannot pass."""
    import transformers

    from tokenbudget.server.testing.tiny_models import build_tokenizer, padded_vocab_size

    path = tmp_path / "gemma2-capped"
    tokenizer = build_tokenizer(path)
    config = transformers.Gemma2Config(
        vocab_size=padded_vocab_size(len(tokenizer)),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        num_hidden_layers=4,
        sliding_window=WINDOW,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=3.0,
        query_pre_attn_scalar=16,
        initializer_range=0.2,
        **COMMON,
    )
    torch.manual_seed(2)
    model = transformers.Gemma2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(str(path))
    return str(path)


def _assert_logprobs_match(path: str, prompts, results) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    for prompt, res in zip(prompts, results):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + res.token_ids])).logits[0]
        ref = torch.log_softmax(logits[len(prompt) - 1 : -1].double(), dim=-1)
        for step, (token, lp) in enumerate(zip(res.token_ids, res.logprobs)):
            assert abs(lp[token] - ref[step, token].item()) < 1e-3, (step, token)


# One compile per model (10-30 s each on 2 cores): Gemma-2 on our C++ kernel,
# Mistral on the SDPA reference path; both compute windows and soft-caps.
@pytest.mark.parametrize("arch, backend", [("gemma2", "cpu"), ("mistral", "sdpa")])
def test_compiled_decoder_with_kv_groups_equals_transformers(tmp_path, arch, backend):
    path = _build_capped_gemma2(tmp_path) if arch == "gemma2" else _build(tmp_path, arch)
    shared = _prompts(1, [3 * WINDOW + 5], seed=7)[0]
    prompts = [shared, *_prompts(2, [2 * WINDOW + 3, 70]), shared + [17, 18, 19]]
    expected = _expected(path, prompts, NEW)
    llm = LLM(
        path,
        enforce_eager=False,
        attention_backend=backend,
        max_num_batched_tokens=24,  # chunks every prompt
        num_gpu_blocks=80,
        block_size=BS,
        max_model_len=96,
        async_scheduling=False,
    )
    decoder = llm.engine.executor.worker.model_runner.compiled
    assert decoder is not None, "a model with KV cache groups stayed eager"
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=1)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params)
    hit = llm.generate({"prompt_token_ids": prompts[3]}, params)[0]
    assert [o.token_ids for o in got] + [hit.token_ids] == expected
    assert hit.num_cached_tokens >= 4 * BS  # the shared prefix, several windows long
    assert decoder.num_calls > 10 and decoder.num_compiles == 1
    _assert_logprobs_match(path, prompts, [*got, hit])
    llm.shutdown()

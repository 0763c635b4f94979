"""Any transformers decoder whose attention goes through AttentionInterface
runs on the paged KV cache: tiny GPT-2, Llama, Mistral, Phi, Gemma and Qwen2
checkpoints, greedy token for token equal to transformers' generate(); what
cannot run exactly is refused at load, saying why."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenbudget.core import SamplingParams
from tokenbudget.server import LLM
from tokenbudget.worker.loader import decoder_kv_shape
from tokenbudget.server.testing.tiny_models import QWEN_SPECIAL_TOKENS, build_tiny_decoder

ARCHITECTURES = ("gpt2", "llama", "mistral", "phi", "gemma", "qwen2")
PROMPT_LENS = (5, 16, 41, 70)
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {
        arch: build_tiny_decoder(tmp_path_factory.mktemp(arch), arch, seed=1)
        for arch in ARCHITECTURES
    }


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [
        rng.integers(len(QWEN_SPECIAL_TOKENS), vocab_size - 64, size=n).tolist()
        for n in PROMPT_LENS
    ]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_equals_transformers_generate(checkpoints, arch):
    from transformers import AutoModelForCausalLM

    path = checkpoints[arch]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size)
    with torch.no_grad():
        expected = [
            hf.generate(
                torch.tensor([p]),
                max_new_tokens=MAX_NEW_TOKENS,
                min_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    # A 32-token budget chunks the longer prompts and mixes them with decodes.
    llm = LLM(path, max_num_batched_tokens=32, num_gpu_blocks=48, block_size=16)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True),
    )
    assert [o.token_ids for o in outs] == expected
    llm.shutdown()


def test_kv_shape_comes_from_any_config():
    from transformers import GemmaConfig, GPT2Config, MistralConfig

    # GPT-2: n_layer / n_head / n_embd, no num_key_value_heads (multi-head attention).
    assert decoder_kv_shape(GPT2Config(n_layer=3, n_head=4, n_embd=64)) == (3, 4, 16)
    # Mistral: grouped-query attention, head_dim given.
    assert decoder_kv_shape(
        MistralConfig(
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            hidden_size=64,
            head_dim=32,
        )
    ) == (2, 2, 32)
    # Gemma: a single KV head whose head_dim is not hidden / heads.
    assert decoder_kv_shape(
        GemmaConfig(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            hidden_size=64,
            head_dim=32,
        )
    ) == (2, 1, 32)


def test_a_sliding_window_narrower_than_the_context_does_not_cap_max_model_len(tmp_path):
    # Its layers get their own KV cache group (tests/worker/test_hybrid_kv.py).
    path = build_tiny_decoder(tmp_path / "mistral", "mistral", sliding_window=64)
    llm = LLM(path, num_gpu_blocks=16, max_model_len=128)
    assert llm.scheduler_config.max_model_len == 128
    out = llm.generate(
        {"prompt_token_ids": list(range(10, 60))},
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    )[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 40
    llm.shutdown()


@pytest.mark.parametrize(
    "config_name, settings, reason",
    [
        (
            "T5Config",
            dict(vocab_size=128, d_model=32, num_layers=1, num_heads=2),
            "is an encoder-decoder; tokenbudget serves decoder-only models",
        )
    ],
)
def test_models_the_paged_attention_cannot_run_are_refused_at_load(
    tmp_path, config_name, settings, reason
):
    import transformers

    getattr(transformers, config_name)(**settings).save_pretrained(tmp_path)  # no weights needed
    with pytest.raises(ValueError, match=reason):
        LLM(str(tmp_path), num_gpu_blocks=8)

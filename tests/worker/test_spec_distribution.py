"""At temperature 1, tokens sampled with n-gram drafts follow the model's exact law.

A tiny decoder with a 4-token vocabulary (random weights scaled up so its next-token
distributions are peaked and depend on the context) generates 4 tokens after a
repetitive prompt, for 3000 unseeded requests, through the real engine (scheduler,
worker, proposer, verification). With prompt_lookup_min = 1 every decode step verifies
3 drafts. The exact law of the 4-token outputs (256 sequences) comes from transformers'
forward over every prefix. Pearson's chi-square over the sequences (cells expected
below 5 pooled) is compared with its critical value at p = 0.001: a correct engine fails
once in a thousand seeds (torch's global seed is fixed here, so the test is
deterministic). The same check is run without drafts, and on an engine whose verifier
accepts every draft, which it must reject."""

from __future__ import annotations

import math

import pytest
import torch

from tokenbudget.core import CacheConfig, Request, SamplingParams, SchedulerConfig
from tokenbudget.server.engine.core import EngineCore

VOCAB = 4
PROMPT = [0, 1, 2, 3, 0, 1, 2, 0, 1]
NUM_TOKENS = 4
NUM_REQUESTS = 3000
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 2,
}


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked, context-dependent next-token laws
    path = tmp_path_factory.mktemp("vocab4")
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def exact_law(tiny_vocab_model) -> dict[tuple[int, ...], float]:
    """P(output = s) for every s in VOCAB**NUM_TOKENS, from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_vocab_model, dtype=torch.float64).eval()
    law = {(): 1.0}
    for _ in range(NUM_TOKENS):
        prefixes = list(law)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1]
        probs = torch.softmax(logits, dim=-1).tolist()
        law = {p + (t,): law[p] * probs[i][t] for i, p in enumerate(prefixes) for t in range(VOCAB)}
    return law


def sample(path: str, spec: dict | None) -> tuple[list[tuple[int, ...]], EngineCore]:
    from tokenbudget.server.executor.inprocess import InProcessExecutor
    from tokenbudget.worker.worker import Worker

    worker = Worker(path, dtype="float32", device="cpu", attention_backend="sdpa", seed=11)
    core = EngineCore(
        SchedulerConfig(
            max_num_seqs=512, max_num_batched_tokens=8192, max_model_len=64, speculative_config=spec
        ),
        CacheConfig(block_size=16, num_blocks=2 * NUM_REQUESTS),
        InProcessExecutor(worker),
    )
    params = SamplingParams(temperature=1.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    for i in range(NUM_REQUESTS):
        core.add_request(Request(str(i), PROMPT, params, eos_token_id=None, arrival_time=i))
    outputs: dict[str, list[int]] = {str(i): [] for i in range(NUM_REQUESTS)}
    while core.has_unfinished_requests():
        for out in core.step():
            outputs[out.request_id] += out.new_token_ids
    return [tuple(outputs[str(i)]) for i in range(NUM_REQUESTS)], core


def chi_square(samples: list[tuple[int, ...]], law: dict) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom, cells expected below 5 pooled."""
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    n = len(samples)
    big = [c for c in law if n * law[c] >= 5]
    small = [c for c in law if n * law[c] < 5]
    cells = [(counts.get(c, 0), n * law[c]) for c in big]
    if small:
        cells.append((sum(counts.get(c, 0) for c in small), n * sum(law[c] for c in small)))
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


def critical_p001(df: int) -> float:
    """Chi-square quantile at 1 - 0.001 (Wilson-Hilferty; within 1% for df >= 3)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("spec", [SPEC, None], ids=["drafts", "no-drafts"])
def test_sampled_tokens_follow_the_exact_law(tiny_vocab_model, exact_law, spec):
    samples, core = sample(tiny_vocab_model, spec)
    stat, df = chi_square(samples, exact_law)
    assert df >= 10  # enough cells to tell laws apart
    assert stat < critical_p001(df), f"chi-square {stat:.1f} >= {critical_p001(df):.1f}, df {df}"
    if spec is not None:
        stats = core.scheduler.make_stats().spec_decoding
        # Every decode step verified drafts; some were accepted, some rejected.
        assert stats.num_drafts >= NUM_REQUESTS
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_the_check_rejects_an_engine_that_accepts_every_draft(
    tiny_vocab_model, exact_law, monkeypatch
):
    from tokenbudget.worker import step_sampling

    monkeypatch.setattr(
        step_sampling, "num_accepted", lambda sampled, drafts, num_rows: num_rows - 1
    )
    samples, _ = sample(tiny_vocab_model, SPEC)
    stat, df = chi_square(samples, exact_law)
    assert stat > critical_p001(df)

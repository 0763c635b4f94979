"""Penalties, logit_bias, bad words, allowed_token_ids and min_tokens through the real engine on
the tiny Qwen3: greedy tokens equal transformers (generate with repetition_penalty and
bad_words_ids; a naive loop for frequency and presence), also across async scheduling, chunked
prefill, preemption and speculative drafts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenbudget.core import (
    CacheConfig,
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
)
from tokenbudget.server import LLM
from tokenbudget.worker.model_runner import ModelRunner
from tokenbudget.worker.sampler import SamplingMetadata

MAX_TOKENS = 16


def greedy(**kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(
        temperature=0.0, min_tokens=kwargs["max_tokens"], ignore_eos=True, **kwargs
    )


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(7, 1152, size=n).tolist() for n in (3, 16, 33, 100, 180)]


@pytest.fixture(scope="module")
def hf_generate(hf_model):
    def generate(prompt: list[int], max_new_tokens: int = MAX_TOKENS, **kwargs) -> list[int]:
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                **kwargs,
            )
        return out[0, len(prompt) :].tolist()

    return generate


@pytest.fixture(scope="module")
def llm(tiny_qwen3_path):
    return make_llm(tiny_qwen3_path)


def make_llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("num_gpu_blocks", 256)
    return LLM(path, dtype="float32", device="cpu", **kwargs)


def generate(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [r.token_ids for r in results]


# Per prompt, batched together; 1.0 uses none.
PENALTIES = (1.5, 2.0, 1.0, 1.2, 0.7)


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"async_scheduling": True}, {"max_num_batched_tokens": 64, "block_size": 4}],
    ids=["one-batch", "async", "chunked-prefill"],
)
def test_greedy_repetition_penalty_equals_transformers_generate(
    tiny_qwen3_path, prompts, hf_generate, engine_args
):
    expected = [hf_generate(p, repetition_penalty=r) for p, r in zip(prompts, PENALTIES)]
    assert expected != [hf_generate(p) for p in prompts]  # the penalty changes the output
    llm = make_llm(tiny_qwen3_path, **engine_args)
    assert generate(llm, prompts, [greedy(repetition_penalty=r) for r in PENALTIES]) == expected


def test_repetition_penalty_survives_preemption(tiny_qwen3_path, hf_generate):
    """A resumed request's history is its prompt plus the outputs it had: 16 blocks of 16 admit
    four 60-token prompts but not their growth to 100 tokens."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, 1000, size=60).tolist() for _ in range(4)]
    expected = [hf_generate(p, 40, repetition_penalty=1.3) for p in prompts]
    llm = make_llm(tiny_qwen3_path, num_gpu_blocks=20, enable_prefix_caching=False)
    assert generate(llm, prompts, greedy(max_tokens=40, repetition_penalty=1.3)) == expected
    assert llm.engine.scheduler.make_stats().num_preemptions > 0


def naive_penalised_generate(
    hf_model, prompt: list[int], frequency: float, presence: float, bias: dict[int, float]
) -> list[int]:
    """Greedy, full forward each step, logit_bias and OpenAI's penalties over the output by
    hand."""
    output: list[int] = []
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + output])).logits[0, -1]
        for t, b in bias.items():
            logits[t] += b
        for t in set(output):
            logits[t] -= frequency * output.count(t) + presence
        output.append(int(logits.argmax()))
    return output


def test_greedy_frequency_and_presence_penalties_equal_a_naive_loop(
    llm, prompts, hf_model, hf_generate
):
    """A token favoured by logit_bias +3 repeats: presence 1.0 takes 1 from it once, so it stays
    ahead to the end; frequency 1.0 takes 1 per occurrence, so it comes back a few times and
    then yields. Each prompt runs frequency only, presence only and both, in one batch.

    Breaks this catches (each tried): the worker applying presence where frequency was asked,
    and counting each output token once (``counts.clamp(max=1)`` for frequency)."""
    chosen = prompts[1:4]
    settings = [(1.0, 0.0), (0.0, 1.0), (0.5, 0.5)]
    rows = [(p, {hf_generate(p, 1)[0]: 3.0}, f, pr) for p in chosen for f, pr in settings]
    expected = [naive_penalised_generate(hf_model, p, f, pr, bias) for p, bias, f, pr in rows]
    for k in range(0, len(rows), len(settings)):
        frequency_only, presence_only, _ = expected[k : k + len(settings)]
        assert frequency_only != presence_only
        (favoured,) = rows[k][1]
        # The favoured token repeats under both: the count is what tells them apart.
        assert 1 < frequency_only.count(favoured) < presence_only.count(favoured)
    params = [
        greedy(frequency_penalty=f, presence_penalty=pr, logit_bias=bias) for _, bias, f, pr in rows
    ]
    assert generate(llm, [p for p, *_ in rows], params) == expected


def test_logit_bias_forces_its_token(llm, prompts):
    forced = 777
    params = [
        greedy(logit_bias={forced: 100.0}),
        SamplingParams(
            temperature=1.0,
            seed=3,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            logit_bias={forced: 100.0},
        ),
    ]
    assert generate(llm, prompts[:2], params) == [[forced] * MAX_TOKENS] * 2


def test_bad_words_are_never_generated(llm, prompts, hf_generate):
    """A one-token word (the free output's first token) and a two-token word that the output
    with only the one-token ban produces at tokens 5 and 6: with both banned the output follows
    that one up to token 5 and then turns away. Oracle: transformers' bad_words_ids (whose
    rule also reads the prompt: it ends in no first token of the pair, so the rules agree).

    Break this catches (tried): the worker's bad-words processor dropping multi-token words.
    The old test took its pair from the free output, which the one-token ban had already
    changed: it passed under that break."""
    prompt = prompts[3]
    single = hf_generate(prompt)[0]
    only_single = hf_generate(prompt, bad_words_ids=[[single]])
    pair = only_single[5:7]
    assert prompt[-1] != pair[0] and single not in pair
    expected = hf_generate(prompt, bad_words_ids=[[single], pair])
    assert expected[:6] == only_single[:6] and expected[6] != pair[1]
    params = [greedy(bad_words_token_ids=[[single]]), greedy(bad_words_token_ids=[[single], pair])]
    assert generate(llm, [prompt, prompt], params) == [only_single, expected]
    assert single not in expected
    assert all(expected[i : i + 2] != pair for i in range(len(expected) - 1))


@pytest.mark.parametrize("favoured", ["eos", "stop_id"])
def test_min_tokens_masks_eos_and_stop_ids_like_generate(llm, prompts, hf_model, favoured):
    """Below min_tokens a row may not pick EOS or a stop id (generate's min_new_tokens masks
    them too); biased to the top, the first one allowed ends the request right at min_tokens."""
    eos, stop_id = hf_model.generation_config.eos_token_id, 5
    bias = {eos: 50.0, stop_id: 60.0 if favoured == "stop_id" else 40.0}
    params = SamplingParams(
        temperature=0.0, max_tokens=12, min_tokens=6, logit_bias=bias, stop_token_ids=[stop_id]
    )
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=12,
                min_new_tokens=6,
                do_sample=False,
                eos_token_id=[eos, stop_id],
                sequence_bias={(t,): b for t, b in bias.items()},
            )
        expected = out[0, len(prompt) :].tolist()
        assert result.token_ids == expected
        assert len(expected) == 7 and expected[-1] == (eos if favoured == "eos" else stop_id)
        assert result.finish_reason == "stop"


def test_allowed_token_ids_hold_at_temperature_one(llm, prompts):
    allowed = [11, 97, 400, 401, 1000]
    params = [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            allowed_token_ids=allowed,
        )
        for s in range(4)
    ]
    outputs = generate(llm, prompts[:4], params)
    seen = {t for out in outputs for t in out}
    assert seen <= set(allowed)
    assert len(seen) >= 3  # sampled, not pinned to one token


# -- speculative drafts, driven through the ModelRunner by hand-built steps ------------------
BS = 16


@pytest.fixture
def runner(tiny_qwen3_path):
    r = ModelRunner(tiny_qwen3_path, dtype="float32", device="cpu", attention_backend="sdpa")
    r.initialize_kv_cache(
        CacheConfig(block_size=BS, num_blocks=64),
        SchedulerConfig(max_num_seqs=4, max_model_len=256),
    )
    return r


def prefill(
    runner: ModelRunner, requests: dict[str, tuple[list[int], SamplingParams]]
) -> list[list[int]]:
    """Whole prompts in one step; each request's first token."""
    # 8 blocks of 16 tokens each: room for prompts of up to 100 tokens and their drafts.
    new = [
        NewRequestData(rid, prompt, [], params, list(range(1 + 8 * i, 9 + 8 * i)), 0)
        for i, (rid, (prompt, params)) in enumerate(requests.items())
    ]
    num_tokens = {n.req_id: len(n.prompt_token_ids) for n in new}
    out = runner.execute_model(
        SchedulerOutput(new, CachedRequestData(), num_tokens, sum(num_tokens.values()))
    )
    return out.sampled_token_ids


def verify(runner: ModelRunner, requests: dict[str, tuple[int, list[int]]]) -> list[list[int]]:
    """One decode step; `requests`: id -> (num_computed_tokens, drafts). The tokens kept."""
    cached = CachedRequestData(
        req_ids=list(requests),
        new_block_ids=[[] for _ in requests],
        num_computed_tokens=[c for c, _ in requests.values()],
    )
    num_tokens = {rid: 1 + len(drafts) for rid, (_, drafts) in requests.items()}
    out = runner.execute_model(
        SchedulerOutput(
            [],
            cached,
            num_tokens,
            sum(num_tokens.values()),
            scheduled_spec_decode_tokens={rid: d for rid, (_, d) in requests.items() if d},
        )
    )
    return out.sampled_token_ids


def test_a_verifying_row_sees_the_drafts_before_it_as_output(
    runner, prompts, hf_model, hf_generate
):
    """Bad word [a, b] with a = the draft before the row: the row must ban b, the model's own
    choice, and pick its runner-up instead."""
    prompt = prompts[1]
    free = hf_generate(prompt, 3)
    assert free[0] != free[1]  # the word does not fire at the first row already
    params = greedy(max_tokens=64, bad_words_token_ids=[free[1:3]])
    assert prefill(runner, {"r": (prompt, params)}) == [free[:1]]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + free[:2]])).logits[0, -1]
    logits[free[2]] = float("-inf")
    assert verify(runner, {"r": (len(prompt), free[1:3])}) == [[free[1], int(logits.argmax())]]


def test_greedy_repetition_penalty_with_drafts_equals_transformers(runner, prompts, hf_generate):
    """Drafts equal to the penalised reference are all kept, each row penalising the drafts
    before it (and none of another request's) as output."""
    chosen = {"a": prompts[3], "b": prompts[1], "c": prompts[0]}
    # < 1 favours seen tokens: a row blind to a draft would not repeat it.
    expected = {rid: hf_generate(p, 10, repetition_penalty=0.7) for rid, p in chosen.items()}
    params = greedy(max_tokens=64, repetition_penalty=0.7)
    assert prefill(runner, {rid: (p, params) for rid, p in chosen.items()}) == [
        e[:1] for e in expected.values()
    ]
    # b verifies no drafts; a and c verify four, then three.
    first = verify(
        runner,
        {
            "a": (len(chosen["a"]), expected["a"][1:5]),
            "b": (len(chosen["b"]), []),
            "c": (len(chosen["c"]), expected["c"][1:5]),
        },
    )
    assert first == [expected["a"][1:6], expected["b"][1:2], expected["c"][1:6]]
    second = verify(
        runner,
        {
            "a": (len(chosen["a"]) + 5, expected["a"][6:9]),
            "b": (len(chosen["b"]) + 1, []),
            "c": (len(chosen["c"]) + 5, expected["c"][6:9]),
        },
    )
    assert second == [expected["a"][6:10], expected["b"][2:3], expected["c"][6:10]]


def test_each_row_of_a_step_sees_its_own_output_and_the_drafts_before_it(
    runner, prompts, monkeypatch
):
    chosen = {"a": prompts[1], "b": prompts[0], "c": prompts[2]}
    params = greedy(max_tokens=64, presence_penalty=1.0)
    a, b, c = prefill(runner, {rid: (p, params) for rid, p in chosen.items()})
    seen = []
    from_params = SamplingMetadata.from_params.__func__

    def spy(cls, params, generators, device, history=None, eos_token_ids=None):
        # Read now: the step's kept tokens overwrite the drafts in the batch afterwards.
        seen.extend(
            (history.output(j).tolist(), int(history.num_prompt_tokens[j]))
            for j in range(len(params))
        )
        return from_params(cls, params, generators, device, history, eos_token_ids)

    monkeypatch.setattr(SamplingMetadata, "from_params", classmethod(spy))
    drafts = {"a": [5, 6], "b": [], "c": [7, 8, 9]}
    verify(runner, {rid: (len(p), drafts[rid]) for rid, p in chosen.items()})
    assert seen == [
        (a, 16),
        (a + [5], 16),
        (a + [5, 6], 16),
        (b, 3),
        (c, 33),
        (c + [7], 33),
        (c + [7, 8], 33),
        (c + [7, 8, 9], 33),
    ]

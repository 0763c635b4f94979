"""What the offline LLM returns for the OpenAI/vLLM output fields: stop strings
over several tokens, n samples sharing the prompt's KV, prompt logprobs under
chunked prefill and a warm prefix cache, prompt truncation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenbudget.core import SamplingParams
from tokenbudget.server import LLM


@pytest.fixture(scope="module")
def llm(tiny_qwen3_path):
    # A small budget so 40+ token prompts prefill in several chunks.
    engine = LLM(tiny_qwen3_path, max_num_batched_tokens=16, num_gpu_blocks=256)
    yield engine
    engine.shutdown()


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def _clean_span(llm, token_ids: list[int], num_tokens: int) -> tuple[int, str, str]:
    """A stop string spanning ``num_tokens`` tokens of ``token_ids``' text: it starts
    inside token k and ends inside token k + num_tokens - 1, and occurs nowhere
    earlier. Returns (k, the text before the stop string, the stop string)."""
    decode = llm.input_processor.decode
    pieces = [decode([t]) for t in token_ids]
    for k in range(len(token_ids) - num_tokens):
        span = pieces[k : k + num_tokens]
        if any("\ufffd" in p or len(p.strip()) < 2 for p in span):
            continue
        before = "".join(pieces[:k]) + span[0][:1]
        stop = span[0][1:] + "".join(span[1:-1]) + span[-1][:1]
        text = decode(token_ids)
        if text.startswith(before + stop) and (before + stop).find(stop) == len(before):
            return k, before, stop
    pytest.skip("no clean token span in this output")


@pytest.mark.parametrize("num_tokens", [2, 3])
def test_a_stop_string_over_several_tokens_cuts_the_text_there(llm, prompts, num_tokens):
    full = llm.generate({"prompt_token_ids": prompts[3]}, _greedy(24))[0]
    k, before, stop = _clean_span(llm, full.token_ids, num_tokens)
    last = k + num_tokens  # tokens kept: through the one completing the stop string

    out = llm.generate({"prompt_token_ids": prompts[3]}, _greedy(24, stop=["@@never", stop]))[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (before, "stop", stop)
    assert out.token_ids == full.token_ids[:last]

    out = llm.generate(
        {"prompt_token_ids": prompts[3]}, _greedy(24, stop=[stop], include_stop_str_in_output=True)
    )[0]
    assert out.text == before + stop and out.token_ids == full.token_ids[:last]


def test_a_stop_string_that_never_completes_is_emitted_in_full(llm, prompts):
    full = llm.generate({"prompt_token_ids": prompts[2]}, _greedy(12))[0]
    # Its start is the end of the output, so it is held back until the sample ends.
    stop = full.text[-2:] + "\u2603never"
    out = llm.generate({"prompt_token_ids": prompts[2]}, _greedy(12, stop=[stop]))[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (full.text, "length", None)


@pytest.mark.parametrize("stop", [None, ["@@never"]], ids=["token-ids-only", "and-stop-strings"])
def test_a_stop_tokens_text_is_output_only_with_include_stop_str_in_output(llm, prompts, stop):
    """vLLM's rule: a sample ended by a stop token (a stop_token_ids id, or EOS) outputs its
    id, and its text only with include_stop_str_in_output. The stop id is an ordinary token of
    the free output (its text is not empty); EOS is forced after min_tokens by logit_bias and
    shown by skip_special_tokens=False, spaces_between_special_tokens=False."""
    decode = llm.input_processor.decode
    prompt = {"prompt_token_ids": prompts[3]}
    free = llm.generate(prompt, _greedy(12))[0].token_ids
    k = next(k for k in range(2, len(free)) if free[k] not in free[:k] and decode(free[k : k + 1]))
    for include in (False, True):
        out = llm.generate(
            prompt,
            _greedy(12, stop=stop, stop_token_ids=[free[k]], include_stop_str_in_output=include),
        )[0]
        assert (out.finish_reason, out.stop_reason) == ("stop", free[k])
        assert out.token_ids == free[: k + 1]
        assert out.text == decode(free[: k + 1] if include else free[:k])
    eos = llm.eos_token_ids[0]
    for include in (False, True):
        out = llm.generate(
            prompt,
            SamplingParams(
                max_tokens=12,
                temperature=0,
                min_tokens=3,
                logit_bias={eos: 100.0},
                stop=stop,
                skip_special_tokens=False,
                spaces_between_special_tokens=False,
                include_stop_str_in_output=include,
            ),
        )[0]
        assert (out.finish_reason, out.stop_reason) == ("stop", None)
        assert out.token_ids == free[:3] + [eos]
        assert out.text == decode(out.token_ids if include else free[:3], skip_special_tokens=False)


def test_n_samples_are_reproducible_distinct_and_share_the_prompt(llm, prompts):
    prompt = {"prompt_token_ids": prompts[4]}  # 64 tokens: 3 full blocks are shareable
    params = SamplingParams(n=4, seed=11, temperature=1.0, max_tokens=8, ignore_eos=True)
    llm.engine.scheduler.reset_prefix_cache()
    first = llm.generate(prompt, params)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2, 3]
    # The prompt is computed once: samples 1..3 find its full blocks cached.
    shared = (len(prompts[4]) - 1) // 16 * 16
    assert [o.num_cached_tokens for o in first.outputs] == [0, shared, shared, shared]
    samples = [o.token_ids for o in first.outputs]
    assert len({tuple(s) for s in samples}) == 4
    assert [o.token_ids for o in llm.generate(prompt, params)[0].outputs] == samples
    # Sample i is what seed + i gives alone, computing the prompt itself.
    for i, tokens in enumerate(samples):
        llm.engine.scheduler.reset_prefix_cache()
        alone = llm.generate(
            prompt, SamplingParams(seed=11 + i, temperature=1.0, max_tokens=8, ignore_eos=True)
        )[0]
        assert alone.num_cached_tokens == 0 and alone.token_ids == tokens


def test_n_greedy_samples_with_stop_strings_each_stop(llm, prompts):
    full = llm.generate({"prompt_token_ids": prompts[3]}, _greedy(24))[0]
    _, before, stop = _clean_span(llm, full.token_ids, 2)
    out = llm.generate({"prompt_token_ids": prompts[3]}, _greedy(24, n=3, stop=[stop]))[0]
    assert [(o.text, o.finish_reason, o.stop_reason) for o in out.outputs] == [
        (before, "stop", stop)
    ] * 3


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_equal_a_full_forward_under_chunked_prefill(
    tiny_qwen3_path, hf_model, prompts, async_scheduling
):
    prompt = prompts[5]  # 100 tokens: 7 chunks of 16
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    engine = LLM(
        tiny_qwen3_path,
        max_num_batched_tokens=16,
        num_gpu_blocks=256,
        async_scheduling=async_scheduling,
    )
    try:
        params = _greedy(3, prompt_logprobs=2)
        for attempt in range(2):  # the second finds the prompt cached: it must not use it
            out = engine.generate({"prompt_token_ids": prompt}, params)[0]
            assert out.num_cached_tokens == 0
            plp = out.prompt_logprobs
            assert len(plp) == len(prompt) and plp[0] is None
            for j in range(1, len(prompt)):
                row = expected[j - 1]
                top = row.topk(2).indices.tolist()
                assert set(plp[j]) == {prompt[j], *top}, j
                got = np.array([plp[j][t] for t in [prompt[j], *top]])
                want = row[[prompt[j], *top]].numpy()
                np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        # Another request without prompt logprobs still gets the cached prefix.
        other = engine.generate({"prompt_token_ids": prompt}, _greedy(3))[0]
        assert other.num_cached_tokens > 0 and other.prompt_logprobs is None
        assert other.token_ids == out.token_ids
    finally:
        engine.shutdown()


def test_prompt_logprobs_survive_preemption_once_per_token(tiny_qwen3_path, prompts):
    """A KV cache too small for all four requests: they preempt one another and
    recompute their prompts, yet each prompt token's logprobs come out once."""
    engine = LLM(tiny_qwen3_path, max_num_batched_tokens=32, num_gpu_blocks=20)
    try:
        batch = [{"prompt_token_ids": prompts[i]} for i in (3, 4, 5, 4)]
        outs = engine.generate(batch, _greedy(40, prompt_logprobs=0))
        assert engine.engine.scheduler.num_preemptions > 0
        alone = [engine.generate(p, _greedy(40, prompt_logprobs=0))[0] for p in batch]
        for out, ref, p in zip(outs, alone, batch):
            assert len(out.prompt_logprobs) == len(p["prompt_token_ids"])
            assert out.token_ids == ref.token_ids
            for got, want in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
                assert got.keys() == want.keys()
                np.testing.assert_allclose(list(got.values()), list(want.values()), atol=1e-4)
    finally:
        engine.shutdown()


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, prompts):
    out = llm.generate({"prompt_token_ids": prompts[4]}, _greedy(6, truncate_prompt_tokens=20))[0]
    assert out.prompt_token_ids == prompts[4][-20:]
    ref = llm.generate({"prompt_token_ids": prompts[4][-20:]}, _greedy(6))[0]
    assert out.token_ids == ref.token_ids
    short = llm.generate({"prompt_token_ids": prompts[0]}, _greedy(2, truncate_prompt_tokens=20))
    assert short[0].prompt_token_ids == prompts[0]


@pytest.mark.parametrize(
    "params, message",
    [
        (
            dict(stop_token_ids=[10**6]),
            r"sampling_params.stop_token_ids: token id 1000000 is outside",
        ),
        (dict(logit_bias={5000: 1.0}), r"sampling_params.logit_bias: token id 5000 is outside"),
        (dict(allowed_token_ids=[1, 4096]), r"sampling_params.allowed_token_ids: token id 4096"),
        (dict(bad_words_token_ids=[[1], [2, 9999]]), r"bad_words_token_ids\[1\]: token id 9999"),
        (dict(logprobs=5000), "sampling_params.logprobs must be <= the vocabulary size"),
        (dict(prompt_logprobs=5000), "sampling_params.prompt_logprobs must be <= the vocabulary"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(llm, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("hi", SamplingParams(**params))
    assert not llm.engine.has_unfinished_requests()

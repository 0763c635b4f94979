"""Penalties, logit_bias, allowed_token_ids and bad words change the logits exactly as
transformers' RepetitionPenaltyLogitsProcessor and a naive per-row reference do, only in the rows
that use them; the sampler picks from the processed logits but reports raw logprobs."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.worker.input_batch import InputBatch, TokenHistory
from tokenbudget.worker.sampler import Sampler, SamplingMetadata, make_generator

VOCAB = 64


def make_history(
    prompts: list[list[int]], outputs: list[list[int]], vocab: int = VOCAB
) -> TokenHistory:
    """The rows' tokens in a batch-like array: rows in reverse order, stale tokens after them
    (padding must never read as history)."""
    rng = np.random.default_rng(0)
    n = len(prompts)
    lengths = [len(p) + len(o) for p, o in zip(prompts, outputs)]
    token_ids = rng.integers(0, vocab, size=(n + 2, max(lengths) + 8))
    rows = np.arange(n)[::-1] + 1
    for row, p, o in zip(rows, prompts, outputs):
        token_ids[row, : len(p) + len(o)] = p + o
    return TokenHistory(token_ids, rows, np.array([len(p) for p in prompts]), np.array(lengths))


def reference(
    logits: list[float], p: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """Naive, one row: allowed ids, bad words, logit_bias, repetition (transformers' own
    processor), then frequency and presence over the output, in vLLM's order."""
    x = list(logits)
    if p.allowed_token_ids is not None:
        x = [v if t in p.allowed_token_ids else float("-inf") for t, v in enumerate(x)]
    for word in p.bad_words_token_ids or ():
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
            x[word[-1]] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    row = torch.tensor([x])
    if p.repetition_penalty != 1.0:
        row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(
            torch.tensor([prompt + output]), row
        )
    x = row[0].tolist()
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return torch.tensor(x)


def random_case(rng: random.Random, n: int):
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    # Small vocabulary, long histories: tokens repeat, so counts above 1 are common.
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.choice([0, 1, 5, 30]))] for _ in range(n)]
    logits = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(rng.randrange(99)))
    return prompts, outputs, logits * 4


def processed(logits, params, prompts, outputs):
    md = SamplingMetadata.from_params(
        params, [None] * len(params), "cpu", make_history(prompts, outputs)
    )
    return md.processors.apply(logits)


@pytest.mark.parametrize("seed", range(3))
def test_repetition_penalty_equals_transformers_processor(seed):
    rng = random.Random(seed)
    penalties = [1.0, 1.3, 0.7, 2.0, 1.0, 1.05]
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, repetition_penalty=r)
        for i, r in enumerate(penalties)
    ]
    prompts, outputs, logits = random_case(rng, len(params))
    raw = logits.clone()
    out = processed(logits, params, prompts, outputs)
    assert torch.equal(logits, raw)  # on a copy
    for j, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
        expected = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(
            torch.tensor([prompt + output]), logits[j : j + 1].clone()
        )[0]
        assert torch.equal(out[j], expected), j
        if p.repetition_penalty == 1.0:
            assert torch.equal(out[j], logits[j])
    assert not torch.equal(out[1], logits[1])


PROCESSOR_CASES = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, frequency_penalty=0.5),
    SamplingParams(temperature=0.9, presence_penalty=1.5),
    SamplingParams(temperature=0.0, frequency_penalty=-1.0, presence_penalty=-0.5),
    SamplingParams(temperature=1.0, logit_bias={3: 5.0, 7: -100.0, 60: 0.25}),
    SamplingParams(temperature=0.0, allowed_token_ids=[1, 2, 3, 5, 8, 13, 21]),
    SamplingParams(temperature=1.0, bad_words_token_ids=[[4], [9, 10], [11, 12, 13]]),
    SamplingParams(temperature=0.7),
    SamplingParams(
        temperature=0.0,
        repetition_penalty=1.4,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        logit_bias={0: 2.0},
    ),
    SamplingParams(
        temperature=1.2,
        repetition_penalty=0.8,
        allowed_token_ids=[0, 1, 2, 40],
        bad_words_token_ids=[[1]],
        logit_bias={2: 1.0},
        frequency_penalty=2.0,
    ),
]


@pytest.mark.parametrize("seed", range(4))
def test_every_processor_equals_the_naive_reference(seed):
    rng = random.Random(seed)
    params = PROCESSOR_CASES * 2
    prompts, outputs, logits = random_case(rng, len(params))
    # Make every bad word fire in some row: output ending in each word's prefix.
    outputs[6], outputs[16] = outputs[6] + [9], outputs[16] + [11, 12]
    out = processed(logits, params, prompts, outputs)
    for j, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
        expected = reference(logits[j].tolist(), p, prompt, output)
        torch.testing.assert_close(out[j], expected, rtol=0, atol=1e-6, msg=f"row {j}")
    for j in (0, 7, 10, 17):  # rows that use nothing
        assert torch.equal(out[j], logits[j])


def test_greedy_rows_pick_the_argmax_of_the_processed_logits():
    rng = random.Random(5)
    params = PROCESSOR_CASES * 3
    prompts, outputs, logits = random_case(rng, len(params))
    history = make_history(prompts, outputs)
    md = SamplingMetadata.from_params(params, [None] * len(params), "cpu", history)
    sampled = Sampler()(logits, md).sampled_token_ids
    for j, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
        if p.temperature == 0.0:
            expected = reference(logits[j].tolist(), p, prompt, output)
            assert sampled[j].item() == expected.argmax().item(), j
    # The processors matter here: plain argmax differs in some greedy row.
    greedy = [j for j, p in enumerate(params) if p.temperature == 0.0]
    assert (sampled[greedy] != logits[greedy].argmax(-1)).any()


def test_random_rows_sample_only_allowed_tokens_and_never_banned_ones():
    allowed = [2, 3, 5, 7]
    params = [
        SamplingParams(
            temperature=1.5, allowed_token_ids=allowed, bad_words_token_ids=[[5], [9, 3]], seed=i
        )
        for i in range(400)
    ]
    prompts = [[1]] * len(params)
    outputs = [[9]] * len(params)  # [9, 3] fires: 3 is banned too
    logits = torch.zeros(len(params), VOCAB)
    md = SamplingMetadata.from_params(
        params,
        [make_generator(i, "cpu") for i in range(400)],
        "cpu",
        make_history(prompts, outputs),
    )
    tokens = Sampler()(logits, md).sampled_token_ids
    assert set(tokens.tolist()) == {2, 7}


def test_biased_and_penalised_rows_sample_the_processed_distribution(assert_matches_distribution):
    vocab, n = 6, 6000
    row = [0.5, 1.0, -0.3, 0.2, 0.0, -1.0]
    p = SamplingParams(
        temperature=0.8,
        repetition_penalty=1.6,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        logit_bias={5: 1.5},
    )
    prompt, output = [0, 2], [1, 1, 3]
    expected = (reference(row, p, prompt, output) / p.temperature).softmax(-1).tolist()
    history = make_history([prompt] * n, [output] * n, vocab)
    md = SamplingMetadata.from_params([p] * n, [None] * n, "cpu", history)
    torch.manual_seed(0)
    tokens = Sampler()(torch.tensor([row] * n), md).sampled_token_ids
    assert_matches_distribution(tokens, dict(enumerate(expected)))
    assert tokens.max() < vocab


def test_rows_without_processors_sample_as_if_the_others_had_none():
    """Seeded rows depend only on their own generator and logits: adding processors to other
    rows changes nothing for them, and logprobs stay those of the raw logits."""
    rng = random.Random(3)
    params = PROCESSOR_CASES * 2
    prompts, outputs, logits = random_case(rng, len(params))
    seeded = [
        SamplingParams(temperature=p.temperature, logprobs=3, seed=j) for j, p in enumerate(params)
    ]
    with_processors = [
        SamplingParams(**{**p.to_dict(), "logprobs": 3, "seed": j}) for j, p in enumerate(params)
    ]

    def run(batch):
        md = SamplingMetadata.from_params(
            batch,
            [make_generator(j, "cpu") for j in range(len(batch))],
            "cpu",
            make_history(prompts, outputs),
        )
        return Sampler()(logits, md)

    raw = torch.log_softmax(logits, dim=-1)
    plain, processed_out = run(seeded), run(with_processors)
    untouched = [0, 7, 10, 17]
    assert torch.equal(
        plain.sampled_token_ids[untouched], processed_out.sampled_token_ids[untouched]
    )
    assert not torch.equal(plain.sampled_token_ids, processed_out.sampled_token_ids)
    assert torch.equal(processed_out.logprobs, raw.gather(1, processed_out.logprobs_token_ids))


@pytest.mark.parametrize(
    "output, banned",
    [
        ([], {4}),  # a one-token word is always banned; [7] in the prompt counts not
        ([9], {4, 10}),  # the output ends with [9]
        ([9, 1], {4}),  # ... no longer
        ([11, 12], {4, 13}),  # a three-token word's prefix
        ([12], {4}),  # only part of that prefix
    ],
)
def test_bad_word_bans_its_last_token_right_after_its_prefix(output, banned):
    p = SamplingParams(temperature=0.0, bad_words_token_ids=[[4], [9, 10], [11, 12, 13], [7, 8]])
    logits = torch.zeros(1, VOCAB)
    out = processed(logits, [p], [[3, 7]], [output])
    assert set(torch.isinf(out[0]).nonzero().flatten().tolist()) == banned


def test_unused_processors_build_nothing():
    plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.5)]
    assert SamplingMetadata.from_params(plain, [None, None], "cpu").processors is None
    only_rep = [SamplingParams(repetition_penalty=1.2), SamplingParams()]
    history = make_history([[1, 2], [3]], [[4], []])
    pen = SamplingMetadata.from_params(only_rep, [None, None], "cpu", history).processors
    assert pen.allowed is pen.banned is pen.bias is None
    assert pen.penalties.output_ids is None  # no frequency or presence
    assert pen.penalties.rows.tolist() == [0]
    assert pen.penalties.seen_ids.tolist() == [[1, 2, 4]]


def test_penalties_without_history_are_refused():
    with pytest.raises(ValueError, match="token history"):
        SamplingMetadata.from_params([SamplingParams(presence_penalty=1.0)], [None], "cpu")


def test_history_counts_the_drafts_before_a_verifying_row_as_output():
    batch = InputBatch(max_num_reqs=2, max_model_len=16, max_blocks_per_req=1)
    row = batch.add([5, 6, 7], [])
    batch.append_tokens(row, [8])
    batch.token_ids[row, 4:6] = [20, 21]  # drafts, as ModelRunner._prepare writes them
    history = batch.history(np.array([row] * 3), np.array([3] * 3), np.arange(3))
    assert [history.output(t).tolist() for t in range(3)] == [[8], [8, 20], [8, 20, 21]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_with_no_allowed_token_samples_no_token_and_the_others_are_untouched(temperature):
    """allowed_token_ids that bad words ban after the row's last output token:
    that row samples NO_TOKEN (never a banned id such as 0); the other rows,
    greedy or seeded, sample as before, and their logprobs are still given."""
    from tokenbudget.worker.sampler import NO_TOKEN

    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    params = [
        SamplingParams(temperature=temperature, seed=1, logprobs=2),
        SamplingParams(
            temperature=temperature,
            seed=2,
            allowed_token_ids=[5, 7],
            bad_words_token_ids=[[5], [7, 7]],
            logprobs=2,
        ),
        SamplingParams(temperature=0.0, logprobs=2),
    ]
    gens = [make_generator(p.seed, "cpu") if p.seed is not None else None for p in params]
    history = make_history([[1, 2]] * 3, [[3], [7], [4]])
    md = SamplingMetadata.from_params(params, gens, "cpu", history)
    out = Sampler()(logits, md)
    sampled = out.sampled_token_ids.tolist()
    assert sampled[1] == NO_TOKEN
    assert sampled[2] == logits[2].argmax().item()
    assert 0 <= sampled[0] < VOCAB
    assert out.logprobs.shape == (3, 3)

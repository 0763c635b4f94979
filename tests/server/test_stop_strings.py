"""Stop strings on the detokenized text (SampleState), with a character-level
detokenizer so every boundary is chosen by the test: a stop string split over
tokens ends the sample at the token that completes it, the text is cut before
it (or after it with include_stop_str_in_output), and streamed text never
shows characters a stop string later cuts, nor holds back more than needed."""

from __future__ import annotations

import itertools
import random

import pytest

from tokenbudget.core import RequestOutput, SamplingParams
from tokenbudget.server.engine.output_processor import SampleState


class CharDetokenizer:
    """Token i is the string VOCAB[i]."""

    def __init__(self, vocab: list[str]) -> None:
        self.vocab = vocab
        self.text = ""

    def add(self, token_ids) -> str:
        delta = "".join(self.vocab[t] for t in token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        return ""


VOCAB = ["ab", "c", "d", "EN", "D", "x", "yz", "E", "ND."]


def _ids(*pieces: str) -> list[int]:
    return [VOCAB.index(p) for p in pieces]


def _run(pieces, chunks=1, **params):
    """Feed the tokens ``chunks`` at a time (the last output finishes by length);
    returns (streamed deltas, final finish reason, stop reason, tokens kept)."""
    params.setdefault("max_tokens", 100)
    state = SampleState(0, SamplingParams(**params), CharDetokenizer(VOCAB))
    ids = _ids(*pieces)
    deltas, tokens, finish, reason = [], [], None, None
    for start in range(0, len(ids), chunks):
        last = start + chunks >= len(ids)
        out = RequestOutput("r", ids[start : start + chunks], "length" if last else None)
        delta = state.update([out])
        if delta is None:
            continue
        deltas.append(delta.text)
        tokens += delta.token_ids
        if delta.finish_reason is not None:
            finish, reason = delta.finish_reason, delta.stop_reason
            break
    return deltas, finish, reason, tokens


@pytest.mark.parametrize("chunks", [1, 2, 5])
def test_a_stop_string_split_over_three_tokens_ends_the_sample_at_the_last_one(chunks):
    # "END" arrives as "EN" + "D": the sample ends at "D"; later tokens are dropped.
    deltas, finish, reason, tokens = _run(["ab", "c", "EN", "D", "x", "yz"], chunks, stop=["END"])
    assert "".join(deltas) == "abc"
    assert (finish, reason) == ("stop", "END")
    assert tokens == _ids("ab", "c", "EN", "D")
    deltas, *_ = _run(["ab", "x", "E", "ND.", "yz"], chunks, stop=["END"])
    assert "".join(deltas) == "abx"  # the stop string ends inside a token: the rest is cut


def test_include_stop_str_in_output_keeps_the_stop_string_and_cuts_what_follows_it():
    deltas, finish, reason, tokens = _run(
        ["ab", "E", "ND.", "x"], stop=["END"], include_stop_str_in_output=True
    )
    assert "".join(deltas) == "abEND"
    assert (finish, reason, tokens) == ("stop", "END", _ids("ab", "E", "ND."))


def test_streaming_holds_back_only_a_possible_stop_prefix():
    # After "ab" + "EN", "EN" could begin "END": held back. After "x" it cannot.
    deltas, finish, _, _ = _run(["ab", "EN", "x", "yz"], stop=["END"])
    assert deltas == ["ab", "", "ENx", "yz"]
    assert finish == "length"
    # A never-completed stop string is emitted in full at the end.
    deltas, finish, _, _ = _run(["ab", "E"], stop=["END"])
    assert deltas == ["ab", "E"] and finish == "length"
    # Nothing is held back when no stop string could start at the end.
    assert _run(["ab", "c", "d"], stop=["END"])[0] == ["ab", "c", "d"]


def test_the_earliest_stop_string_wins_and_min_tokens_defers_matching():
    _, _, reason, tokens = _run(["ab", "c", "EN", "D"], stop=["END", "bc"])
    assert (reason, tokens) == ("bc", _ids("ab", "c"))
    # vLLM's rule: stop strings are looked for only once min_tokens are out.
    deltas, _, reason, tokens = _run(["c", "EN", "D", "ab", "c", "x"], stop=["c"], min_tokens=2)
    assert (reason, "".join(deltas), len(tokens)) == ("c", "cENDab", 5)


def test_random_streams_match_a_naive_reference():
    """Any split into tokens and chunks, any min_tokens: the streamed text is the
    reference cut at the first stop string that ends in a token once min_tokens are out."""
    rng = random.Random(0)
    stops = ["END", "yzx", "cd"]
    for _ in range(300):
        pieces = [rng.choice(VOCAB) for _ in range(rng.randint(1, 12))]
        chunks = rng.choice([1, 2, 3])
        stop = rng.sample(stops, rng.randint(1, 3))
        include = rng.random() < 0.5
        min_tokens = rng.choice([0, 0, 2, 4])
        deltas, finish, reason, tokens = _run(
            pieces, chunks, stop=stop, min_tokens=min_tokens, include_stop_str_in_output=include
        )
        # Reference: grow the text token by token; the first token whose text
        # completes a stop string (searching where it could end) stops.
        text, expected = "", "".join(pieces)
        expected_reason, expected_tokens = None, len(pieces)
        for k, p in enumerate(pieces):
            before = len(text)
            text += p
            if k + 1 <= min_tokens:
                continue  # stop strings are looked for once min_tokens are out
            hits = [(text.find(s, max(0, before - len(s) + 1)), s) for s in stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                expected = text[: i + len(s)] if include else text[:i]
                expected_reason, expected_tokens = s, k + 1
                break
        assert "".join(deltas) == expected, (pieces, stop)
        assert reason == expected_reason and len(tokens) == expected_tokens
        assert finish == ("stop" if expected_reason else "length")


def test_several_outputs_fold_into_one_delta_and_a_stopped_sample_ignores_the_rest():
    state = SampleState(2, SamplingParams(stop=["END"]), CharDetokenizer(VOCAB))
    outs = [RequestOutput("r", _ids("ab"), None), RequestOutput("r", _ids("EN", "D", "x"), None)]
    delta = state.update(outs)
    assert (delta.index, delta.text, delta.token_ids) == (2, "ab", _ids("ab", "EN", "D"))
    assert state.stopped_by_string and state.finished
    assert state.update([RequestOutput("r", _ids("yz"), "length")]) is None


def test_token_ids_only_samples_pass_outputs_through():
    state = SampleState(0, SamplingParams(), None)
    out = RequestOutput("r", [5, 6], "stop", [{5: -1.0}, {6: -2.0}], stop_reason=6)
    delta = state.update([out])
    assert (delta.token_ids, delta.text, delta.finish_reason, delta.stop_reason) == (
        [5, 6],
        "",
        "stop",
        6,
    )
    assert delta.logprobs == [{5: -1.0}, {6: -2.0}]


@pytest.mark.parametrize("pieces", list(itertools.permutations(["E", "N", "D"]))[:3])
def test_a_stop_string_of_single_characters_in_any_order(pieces):
    vocab = ["E", "N", "D"]
    state = SampleState(0, SamplingParams(stop=["END"]), CharDetokenizer(vocab))
    ids = [vocab.index(p) for p in pieces]
    delta = state.update([RequestOutput("r", ids, "length")])
    assert (delta.finish_reason == "stop") == ("".join(pieces) == "END")


@pytest.mark.parametrize("stop_reason", [None, VOCAB.index("x")], ids=["eos", "stop-token-id"])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_text_shows_only_with_include_stop_str_in_output(stop_reason, include):
    """vLLM's rule: a sample the engine stopped at a stop token (EOS: no stop reason; a
    stop_token_ids id) keeps the token's id, and its text only when asked. Its text does not
    complete a stop string either ("cx" here): the stop token is the reason."""
    for stop in ([], ["cx"]):
        state = SampleState(
            0, SamplingParams(stop=stop, include_stop_str_in_output=include), CharDetokenizer(VOCAB)
        )
        first = state.update([RequestOutput("r", _ids("ab"), None)])
        last = state.update([RequestOutput("r", _ids("c", "x"), "stop", stop_reason=stop_reason)])
        text = first.text + last.text
        assert text == ("abcx" if include else "abc"), stop
        assert last.token_ids == _ids("c", "x")
        assert (last.finish_reason, last.stop_reason) == (
            "stop",
            "cx" if include and stop else stop_reason,
        )


def _reference_deltas(pieces, chunks, stop, include, min_tokens):
    """The streamed deltas by the per-string rule (every string searched and
    checked for hold-back on every token), as the matcher was before issue 26."""
    text, sent, deltas = "", 0, []
    for start in range(0, len(pieces), chunks):
        stopped = False
        for k in range(start, min(start + chunks, len(pieces))):
            before = len(text)
            text += pieces[k]
            if k + 1 <= min_tokens:
                continue
            hits = [(text.find(s, max(0, before - len(s) + 1)), i, s) for i, s in enumerate(stop)]
            hits = [(i, j, s) for i, j, s in hits if i >= 0]
            if hits:
                i, _, s = min(hits)
                text = text[: i + len(s)] if include else text[:i]
                stopped = True
                break
        last = stopped or start + chunks >= len(pieces)
        held = 0
        if not include and not last:
            unsent = text[sent:]
            held = max(
                (
                    k
                    for s in stop
                    for k in range(1, min(len(s) - 1, len(unsent)) + 1)
                    if unsent.endswith(s[:k])
                ),
                default=0,
            )
        deltas.append(text[sent : len(text) - held])
        sent = len(text) - held
        if stopped:
            break
    return [d for d in deltas]


def test_many_overlapping_stop_strings_stream_as_the_per_string_rule():
    """The automaton (one pass, any number of strings) streams exactly what
    searching each string on every token did: the same cut, the same stop
    string (the earliest, then the first listed), the same hold-back."""
    rng = random.Random(1)
    alphabet = "abcEND"
    for _ in range(400):
        stop = [
            "".join(rng.choices(alphabet, k=rng.randint(1, 5))) for _ in range(rng.randint(1, 40))
        ]
        pieces = [
            "".join(rng.choices(alphabet, k=rng.randint(1, 3))) for _ in range(rng.randint(1, 15))
        ]
        vocab = sorted(set(pieces))
        chunks = rng.choice([1, 2, 3])
        include = rng.random() < 0.5
        min_tokens = rng.choice([0, 0, 2])
        params = SamplingParams(
            max_tokens=100, stop=stop, include_stop_str_in_output=include, min_tokens=min_tokens
        )
        state = SampleState(0, params, CharDetokenizer(vocab))
        ids = [vocab.index(p) for p in pieces]
        deltas = []
        for start in range(0, len(ids), chunks):
            last = start + chunks >= len(ids)
            out = RequestOutput("r", ids[start : start + chunks], "length" if last else None)
            delta = state.update([out])
            deltas.append(delta.text if delta is not None else "")
            if delta is not None and delta.finish_reason is not None:
                break
        expected = _reference_deltas(pieces, chunks, stop, include, min_tokens)
        assert deltas == expected, (pieces, chunks, stop, include, min_tokens)

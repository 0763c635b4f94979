"""Per streamed token: incremental detokenization and stop-string matching.

Prints one JSON line per vocabulary: whether the DecodeStream path, the window
path and a full decode agree on random byte-fragment streams, and
microseconds per token (median of ``--repeat`` runs) for
* ``window``: re-decoding a short window per token (the generic path, used for
  tokenizers without a tokenizers backend);
* ``decode_stream``: the tokenizers library's DecodeStream (fast tokenizers);
* ``sample``: what a streamed sample pays per token without stop strings
  (SampleState over DecodeStream, one RequestOutput per token);
* ``sample_stop``: the same with two stop strings that never match (the worst
  case: every token is decoded alone, searched and checked for hold-back).

    python benchmarks/detokenize.py [--tokens 20000 --vocab-size 150000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


class _NoBackend:
    """The tokenizer without its tokenizers backend: forces the window path."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer_obj = tokenizer
        self.added_tokens_decoder = tokenizer.added_tokens_decoder

    def decode(self, ids, skip_special_tokens=True):
        return self._tokenizer_obj.decode(ids, skip_special_tokens=skip_special_tokens)


def _token_stream(tokenizer, n: int) -> list[int]:
    """Natural text (random words, punctuation, some multi-byte characters) tokenized."""
    rng = random.Random(0)
    words = [
        "the",
        "scheduler",
        "token",
        "budget",
        "café",
        "東京",
        "🙂",
        "naïve",
        "KV",
        "cache",
        "prefix",
        "hit",
        "block",
        "42",
        "3.14",
        "—",
        '"quoted"',
        "new\nline",
    ]
    ids: list[int] = []
    while len(ids) < n:
        text = " ".join(rng.choice(words) for _ in range(200))
        ids += tokenizer.encode(text, add_special_tokens=False)
    return ids[:n]


def _per_token_us(fn, ids: list[int], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(ids)
        times.append((time.perf_counter() - t0) / len(ids) * 1e6)
    return round(statistics.median(times), 3)


def _identical(tokenizer, slow, streams: int = 300) -> bool:
    """DecodeStream, the window path and a full decode give the same text on random ids
    (byte fragments, specials), fed one by one or in bursts."""
    from tokenbudget.server.engine.detokenizer import IncrementalDetokenizer

    rng = random.Random(1)
    for _ in range(streams):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            texts = []
            for tok in (tokenizer, slow):
                d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
                pos, out = 0, []
                while pos < len(ids):
                    n = rng.choice((1, 1, 2, 5))
                    out.append(d.add(ids[pos : pos + n]))
                    pos += n
                texts.append("".join(out) + d.flush())
            if texts[0] != texts[1] or texts[0] != tokenizer.decode(ids, skip_special_tokens=skip):
                return False
    return True


def measure(tokenizer, name: str, num_tokens: int, repeat: int) -> dict:
    from tokenbudget.core import RequestOutput, SamplingParams
    from tokenbudget.server.engine.detokenizer import IncrementalDetokenizer
    from tokenbudget.server.engine.output_processor import SampleState

    ids = _token_stream(tokenizer, num_tokens)

    def detok(make):
        def run(ids):
            d = make()
            for t in ids:
                d.add([t])
            d.flush()

        return run

    def sample(params):
        def run(ids):
            state = SampleState(0, params, IncrementalDetokenizer(tokenizer))
            for t in ids:
                state.update([RequestOutput("r", [t])])

        return run

    slow = _NoBackend(tokenizer)
    result = {
        "vocab": name,
        "vocab_size": len(tokenizer),
        "tokens": len(ids),
        "identical_on_random_fragments": _identical(tokenizer, slow),
    }
    result["window_us"] = _per_token_us(detok(lambda: IncrementalDetokenizer(slow)), ids, repeat)
    result["decode_stream_us"] = _per_token_us(
        detok(lambda: IncrementalDetokenizer(tokenizer)), ids, repeat
    )
    result["sample_us"] = _per_token_us(sample(SamplingParams(max_tokens=10**6)), ids, repeat)
    result["sample_stop_us"] = _per_token_us(
        sample(SamplingParams(max_tokens=10**6, stop=["\n\nUser:", "</answer>"])), ids, repeat
    )
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--vocab-size",
        type=int,
        default=150_000,
        help="also measure a byte-level BPE of this size (0: skip)",
    )
    p.add_argument("--tokenizer-dir", default=str(Path(tempfile.gettempdir()) / "tb-bench"))
    args = p.parse_args()
    from tokenbudget.server.testing.tiny_models import build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tokenizer(tmp)
    print(json.dumps(measure(tiny, "tiny", args.tokens, args.repeat)), flush=True)
    if args.vocab_size:
        from structured_output import big_tokenizer

        big = big_tokenizer(Path(args.tokenizer_dir), args.vocab_size)
        print(
            json.dumps(measure(big, f"bpe{args.vocab_size}", args.tokens, args.repeat)), flush=True
        )


if __name__ == "__main__":
    main()

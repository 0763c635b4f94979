"""The compiled-grammar cache's real size (issue 26 item 13): compile many
distinct grammars (regexes, choices, JSON schemas) through a
StructuredOutputManager whose cache is bounded to ``--cache-mib`` and print
one JSON line per sample: the bytes the cache counts and how far the
process's RSS grew. The bound should hold within 20% in RSS.

    python benchmarks/grammar_cache.py [--cache-mib 64 --grammars 120 --mode process]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def _spec(rng: random.Random, i: int):
    from tokenbudget.core.sampling_params import StructuredOutputParams

    def word() -> str:
        return "".join(rng.choices("abcdefghij", k=8))

    n = rng.randint(1000, 4000)
    if i % 3 == 0:
        return StructuredOutputParams(regex="(" + "|".join(word() for _ in range(n)) + ")")
    if i % 3 == 1:
        return StructuredOutputParams(choice=[word() for _ in range(n)])
    properties = {word(): {"type": "string"} for _ in range(n // 40)}
    return StructuredOutputParams(json_schema={"type": "object", "properties": properties})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-mib", type=int, default=64)
    p.add_argument("--grammars", type=int, default=120)
    p.add_argument("--vocab-size", type=int, default=1200)
    p.add_argument("--mode", choices=("process", "thread"), default="process")
    p.add_argument("--tokenizer-dir", default=str(Path(tempfile.gettempdir()) / "tb-bench"))
    args = p.parse_args()
    from structured_output import big_tokenizer

    from tokenbudget.core.sampling_params import StructuredOutputParams
    from tokenbudget.core.structured.manager import StructuredOutputManager

    tok = big_tokenizer(Path(args.tokenizer_dir), args.vocab_size)
    bound = args.cache_mib << 20
    manager = StructuredOutputManager(
        tok,
        len(tok),
        cache_bytes=bound,
        cache_size=100_000,
        compile_timeout_s=600,
        compile_in_process=args.mode == "process",
    )
    manager._compiled(StructuredOutputParams(regex="[ab]+")).result()  # start-up costs
    gc.collect()
    start = _rss()
    rng = random.Random(0)
    for i in range(args.grammars):
        manager._compiled(_spec(rng, i)).result()
        manager._evict()
        if (i + 1) % 20 == 0:
            gc.collect()
            grown = _rss() - start
            sample = {"mode": args.mode, "grammars": i + 1, "bound_mib": args.cache_mib}
            sample["counted_mib"] = round(manager.cached_bytes / 2**20, 1)
            sample["rss_growth_mib"] = round(grown / 2**20, 1)
            sample["rss_growth_over_bound"] = round(grown / bound, 2)
            print(json.dumps(sample), flush=True)
    manager.shutdown()


if __name__ == "__main__":
    main()

"""Structured-output benchmark; prints one JSON object.

* ``throughput``: N requests, all JSON-schema constrained vs none, the same
  fixed lengths (the schema cannot finish within max_tokens, EOS ignored), on
  the tiny random-weight Qwen3 (or ``--model``), sync and async scheduling.
  Also the time spent filling bitmasks and accepting tokens (scheduler) and
  masking logits, including any wait for a deferred mask (worker).
* ``compile``: a ~150k-token byte-level BPE trained locally (cached in
  ``--tokenizer-dir``): tokenizer-info build, cold compiles per spec kind, and
  the cached path (add_request + is_ready of an already compiled spec).
* ``bitmask``: per-step ``grammar_bitmask`` time at 64/256 structured rows of
  that vocabulary, matchers spread over different JSON states, and the
  worker-side CPU apply time for the same rows.

    python benchmarks/structured_output.py [--num-requests 256 --max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "role", "address", "tags"],
}
# Too long to finish within max_tokens: every structured request runs to the cap.
LONG_SCHEMA = {"type": "array", "items": SCHEMA, "minItems": 64}
SAMPLE_JSON = (
    '{"name": "ada", "age": 36, "role": "admin", "address": {"city": '
    '"London, the old town by the river", "zip": "12345"}, "tags": ["math", "poetry", '
    '"engines"]}'
)
OTHER_SPECS = {
    "regex": r"[a-z]{1,6}-[0-9]{2,4}(\.[A-Z])?",
    "grammar": 'root ::= list\nlist ::= "[" (item ("," item)*)? "]"\nitem ::= [0-9]+ | list',
    "choice": ["yes", "no", "maybe so"],
}


def _timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


# -- throughput ---------------------------------------------------------------------------
def throughput(
    model: str, n: int, max_tokens: int, prompt_len: int, async_scheduling: bool, repeat: int
):
    from tokenbudget.core import SamplingParams
    from tokenbudget.server import LLM

    llm = LLM(
        model,
        max_num_seqs=n,
        max_num_batched_tokens=max(8192, n * prompt_len),
        async_scheduling=async_scheduling,
        max_model_len=prompt_len + max_tokens + 16,
    )
    manager = llm.structured_output
    runner = llm.executor.worker.model_runner
    spent = {"bitmask": 0.0, "accept": 0.0, "mask": 0.0}
    # grammar_bitmask (sync) and the deferred fill (async, in-process) both go
    # through the first two, so timing them counts every fill exactly once.
    # The worker's _apply_grammar: waiting for a deferred mask, then masking.
    timers = [
        (manager, "sampling_req_ids", "bitmask"),
        (manager, "fill_bitmask", "bitmask"),
        (manager, "accept_tokens", "accept"),
        (runner, "_apply_grammar", "mask"),
    ]
    for owner, name, key in timers:
        inner = getattr(owner, name)

        def timed(*a, _inner=inner, _key=key):
            t = time.perf_counter()
            try:
                return _inner(*a)
            finally:
                spent[_key] += time.perf_counter() - t

        setattr(owner, name, timed)
    rng = random.Random(0)
    vocab = len(llm.tokenizer)
    prompts = [
        {"prompt_token_ids": [rng.randrange(16, vocab) for _ in range(prompt_len)]}
        for _ in range(n)
    ]

    def params(structured):
        return [
            SamplingParams(
                temperature=1.0,
                seed=i,
                max_tokens=max_tokens,
                ignore_eos=True,
                structured=structured,
            )
            for i in range(n)
        ]

    # Warm up: model kernels and the grammar (its compile is measured separately).
    llm.generate(prompts[:4], params({"json_schema": LONG_SCHEMA})[:4])
    configs = (("none", None), ("json_schema", {"json_schema": LONG_SCHEMA}))
    runs: dict[str, list[tuple[float, dict]]] = {label: [] for label, _ in configs}
    for _ in range(repeat):  # interleaved, so load on a shared box hits both alike
        for label, structured in configs:
            spent.update(bitmask=0.0, accept=0.0, mask=0.0)
            outs, dt = _timed(llm.generate, prompts, params(structured))
            lengths = {len(o.token_ids) for o in outs}
            assert lengths == {max_tokens}, f"{label}: lengths {sorted(lengths)[:5]}"
            runs[label].append((dt, dict(spent)))
    result = {}
    tokens = n * max_tokens
    for label, measured in runs.items():
        dt, used = sorted(measured, key=lambda r: r[0])[len(measured) // 2]  # the median run
        result[label] = {
            "seconds": round(dt, 3),
            "tokens_per_s": round(tokens / dt, 1),
            "all_seconds": [round(r[0], 3) for r in measured],
            "bitmask_ms_total": round(used["bitmask"] * 1e3, 1),
            "accept_ms_total": round(used["accept"] * 1e3, 1),
            "worker_mask_ms_total": round(used["mask"] * 1e3, 1),
        }
    result["structured_over_none"] = round(
        result["json_schema"]["tokens_per_s"] / result["none"]["tokens_per_s"], 3
    )
    # Per pair of neighbouring runs, then their median: robust to drifting load.
    pairs = [a[0] / b[0] for a, b in zip(runs["none"], runs["json_schema"])]
    result["structured_over_none_paired_median"] = round(statistics.median(pairs), 3)
    llm.shutdown()
    return result


# -- a ~150k tokenizer -----------------------------------------------------------------------
def big_tokenizer(directory: Path, vocab_size: int):
    """A byte-level BPE of ``vocab_size`` tokens trained on random words (cached)."""
    from transformers import PreTrainedTokenizerFast

    path = directory / f"bpe{vocab_size}"
    if not (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        rng = random.Random(0)
        alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"

        def lines():
            for _ in range(1500):
                yield " ".join(
                    "".join(rng.choices(alphabet, k=rng.randint(2, 10))) for _ in range(1000)
                )

        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.train_from_iterator(
            lines(),
            trainer=trainers.BpeTrainer(
                vocab_size=vocab_size,
                special_tokens=["<|endoftext|>", "<|im_end|>"],
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                show_progress=False,
            ),
        )
        tok = PreTrainedTokenizerFast(
            tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
        )
        tok.save_pretrained(str(path))
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def _request(rid: str, spec: dict, eos: int):
    from tokenbudget.core import Request, SamplingParams

    return Request(
        rid, [1, 2, 3], SamplingParams(max_tokens=4096, structured=spec), eos_token_id=eos
    )


def compile_times(tokenizer, vocab_size: int):
    from tokenbudget.core import SamplingParams
    from tokenbudget.core.structured.manager import StructuredOutputManager

    manager = StructuredOutputManager(tokenizer, vocab_size)
    _, info_s = _timed(manager._get_compiler)
    specs = {"json_schema": SCHEMA, **OTHER_SPECS}
    cold = {}
    for kind, value in specs.items():
        params = SamplingParams(structured={kind: value}).structured
        _, cold[kind] = _timed(manager.compile, params)
    eos = tokenizer.eos_token_id
    first = _request("warm", {"json_schema": SCHEMA}, eos)
    manager.add_request(first)
    first.structured_request.compiled.result()
    times = []
    for i in range(200):
        req = _request(f"c{i}", {"json_schema": SCHEMA}, eos)
        t = time.perf_counter()
        manager.add_request(req)
        ready = manager.is_ready(req)
        times.append(time.perf_counter() - t)
        assert ready
        manager.remove_request(req)
    manager.shutdown()
    return {
        "tokenizer_info_s": round(info_s, 3),
        "cold_compile_ms": {k: round(v * 1e3, 2) for k, v in cold.items()},
        "cached_add_and_ready_us": round(statistics.median(times) * 1e6, 1),
    }


def bitmask_times(tokenizer, vocab_size: int, rows_list: list[int], steps: int):
    import torch
    import xgrammar as xgr

    from tokenbudget.core.structured.manager import StructuredOutputManager
    from tokenbudget.worker.sampler import apply_token_bitmask

    sample_ids = tokenizer.encode(SAMPLE_JSON)
    eos = tokenizer.eos_token_id
    out = {}
    for rows in rows_list:
        manager = StructuredOutputManager(tokenizer, vocab_size)
        requests = {}
        for i in range(rows):
            req = _request(f"r{i}", {"json_schema": SCHEMA}, eos)
            manager.add_request(req)
            req.structured_request.compiled.result()
            assert manager.is_ready(req)
            # Spread the matchers over the document: structure, numbers, free strings.
            k = i * len(sample_ids) // rows
            req.append_output_token_ids(sample_ids[:k])
            assert not manager.accept_tokens(req, sample_ids[:k])
            req.num_computed_tokens = req.num_tokens - 1
            requests[req.request_id] = req
        scheduled = {rid: 1 for rid in requests}
        manager.grammar_bitmask(requests, scheduled, {})  # warm the fill threads
        fills = []
        for _ in range(steps):
            (bitmask, _), dt = _timed(manager.grammar_bitmask, requests, scheduled, {})
            fills.append(dt)
        logits = torch.randn(rows, vocab_size)
        mask = torch.from_numpy(bitmask)
        applies = []
        for _ in range(steps):
            x = logits.clone()
            _, dt = _timed(apply_token_bitmask, x, mask)
            applies.append(dt)
        reference = []  # xgrammar's own CPU kernel, for comparison
        for _ in range(steps):
            x = logits.clone()
            _, dt = _timed(xgr.apply_token_bitmask_inplace, x, mask)
            reference.append(dt)
        out[str(rows)] = {
            "fill_ms": round(statistics.median(fills) * 1e3, 3),
            "fill_us_per_row": round(statistics.median(fills) / rows * 1e6, 2),
            "cpu_apply_ms": round(statistics.median(applies) * 1e3, 3),
            "xgrammar_cpu_apply_ms": round(statistics.median(reference) * 1e3, 3),
        }
        manager.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint (default: the tiny random Qwen3, built locally)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=150_000)
    p.add_argument("--rows", default="64,256")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="interleaved throughput runs per config (median reported)",
    )
    p.add_argument(
        "--tokenizer-dir", default=str(Path(tempfile.gettempdir()) / "tokenbudget-bench")
    )
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--skip", default="", help="comma list of throughput,compile,bitmask")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.torch_threads)
    skip = set(filter(None, args.skip.split(",")))
    report: dict = {
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "torch_threads": args.torch_threads,
    }
    if "throughput" not in skip:
        model = args.model
        if model is None:
            from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

            model = build_tiny_qwen3(Path(tempfile.mkdtemp()) / "tiny_qwen3")
        report["model"] = args.model or "tiny random Qwen3 (vocab 1216)"
        report["throughput"] = {
            mode: throughput(
                model,
                args.num_requests,
                args.max_tokens,
                args.prompt_len,
                mode == "async",
                args.repeat,
            )
            for mode in ("sync", "async")
        }
    if skip >= {"compile", "bitmask"}:
        print(json.dumps(report, indent=1))
        return
    from tokenbudget.server.testing.tiny_models import padded_vocab_size

    tok, train_s = _timed(big_tokenizer, Path(args.tokenizer_dir), args.vocab_size)
    vocab = padded_vocab_size(len(tok))
    report["big_vocab"] = {
        "tokenizer_tokens": len(tok),
        "model_vocab": vocab,
        "tokenizer_load_or_train_s": round(train_s, 1),
    }
    if "compile" not in skip:
        report["compile"] = compile_times(tok, vocab)
    if "bitmask" not in skip:
        rows = [int(r) for r in args.rows.split(",")]
        report["bitmask"] = bitmask_times(tok, vocab, rows, args.steps)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

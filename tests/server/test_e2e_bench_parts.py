"""The pure parts of benchmarks/e2e_vs_vllm.py (issue 27): the workloads both
engines get, the knobs that must mean the same on both sides, and the greedy
comparison. No vLLM and no model needed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def e2e():
    sys.path.insert(0, str(BENCH))
    try:
        import e2e_driver
        import e2e_serve
        import e2e_vs_vllm

        yield e2e_vs_vllm, e2e_driver, e2e_serve
    finally:
        sys.path.remove(str(BENCH))


def test_workloads_have_the_issue_shapes_and_a_shared_prefix_for_b(e2e):
    bench, _, _ = e2e
    shapes = {}
    for name in "abcd":
        w = bench.make_workload(name, num_tokens=1200)
        shapes[name] = (len(w["prompts"]), len(w["prompts"][0]), w["max_tokens"][0])
        assert all(16 <= t < 1200 for p in w["prompts"] for t in p)
    assert shapes == {
        "a": (256, 128, 128),
        "b": (64, 576, 64),
        "c": (32, 1024, 16),
        "d": (1, 32, 256),
    }
    b = bench.make_workload("b", num_tokens=1200)["prompts"]
    assert all(p[:512] == b[0][:512] for p in b) and len({tuple(p[512:]) for p in b}) == 64


def test_workloads_are_the_same_token_ids_every_time(e2e):
    bench, _, _ = e2e
    assert bench.make_workload("a", 1200) == bench.make_workload("a", 1200)
    assert bench.make_workload("a", 1200, seed=1) != bench.make_workload("a", 1200)


def test_both_engines_get_the_same_kv_token_slots_and_knobs(e2e):
    bench, _, _ = e2e
    ours, vllm = bench.engine_args("ours", {}), bench.engine_args("vllm", {})
    assert vllm["block_size"] * vllm["num_gpu_blocks_override"] == 640 * 128
    assert ours["num_gpu_blocks"] * 16 == 640 * 128  # our default block size
    assert bench.engine_args("ours", {"block_size": 128})["num_gpu_blocks"] == 640
    for key in ("dtype", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching"):
        assert ours[key] == vllm[key]
    assert bench.engine_args("vllm", {"enforce_eager": True})["enforce_eager"] is True


def test_greedy_comparison_counts_requests_and_finds_the_first_difference(e2e):
    bench, _, _ = e2e
    got = bench.token_match([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 9, 6], [7, 8]])
    assert got == {"matched": 2, "of": 3, "first_diff_position_median": 1}


def test_summary_ratios_are_ours_over_vllm(e2e):
    bench, _, _ = e2e

    def run(wall, cpu):
        return {
            "output_tokens": 256,
            "wall_s": wall,
            "cpu_s": cpu,
            "load_s": 1.0,
            "driver_torch_threads": 2,
            "token_ids": [[1] * 256],
        }

    summary = bench.summarize(
        {"d": {"ours": [run(2.0, 4.0), run(1.0, 2.0), run(3.0, 6.0)], "vllm": [run(1.0, 1.0)] * 3}}
    )["d"]
    assert summary["ours"]["output_tokens_per_s"] == 128.0  # the median round
    assert summary["ours"]["ms_per_token"] == 7.812  # 1000 / 128, 3 decimals
    assert summary["ratio_ours_over_vllm"] == {
        "output_tokens_per_s": 0.5,
        "cpu_per_output_token": 4.0,
    }
    assert summary["greedy_tokens"] == {"matched": 1, "of": 1}


def test_cpu_seconds_of_a_process_tree_include_a_busy_child(e2e):
    _, driver, _ = e2e
    import subprocess

    before = driver.tree_cpu_seconds()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt=time.process_time()\n"
            "while time.process_time() - t < 0.3: pass\nimport sys; sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
    )
    try:
        while driver.tree_cpu_seconds(child.pid) < 0.3:
            assert child.poll() is None
        assert driver.tree_cpu_seconds() - before >= 0.3
    finally:
        child.communicate(b"")
    assert driver.tree_cpu_seconds(os.getpid()) >= 0


def test_engine_keywords_become_cli_flags(e2e):
    _, _, serve = e2e
    flags = serve.as_flags(
        {
            "max_num_seqs": 256,
            "enable_prefix_caching": True,
            "dtype": "float32",
            "enforce_eager": False,
        }
    )
    assert flags == [
        "--max-num-seqs",
        "256",
        "--enable-prefix-caching",
        "--dtype",
        "float32",
        "--no-enforce-eager",
    ]

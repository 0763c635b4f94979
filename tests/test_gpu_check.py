"""benchmarks/gpu_check.py cannot rot: its CPU quick mode runs the code paths
the GPU run takes (tiny model) and writes every field with sane values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ITEMS = {
    "environment": {"environment"},
    "correctness": {"backends_vs_sdpa", "greedy_vs_transformers", "gpu_tests"},
    "kv_sizing": {"kv_sizing"},
    "serving": {"served_vs_compute", "structured_output"},
}
DECODE_FIELDS = ("tokens_per_s", "ms_per_step", "forward_ms_per_step", "bytes_read_per_step")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu"]
        + ["--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    data["_out"] = out
    return data


def test_every_item_ran_and_the_checks_passed(report):
    sections = report["sections"]
    for section, items in ITEMS.items():
        assert items <= set(sections[section]), section
    for section, items in sections.items():
        for name, entry in items.items():
            assert entry["status"] in ("ok", "skipped"), (section, name, entry)
            assert entry.get("pass", True) is True, (section, name, entry)
    assert sections["correctness"]["gpu_tests"]["status"] == "skipped"  # CPU: they skip


def test_graphs_on_gave_the_transformers_tokens_through_replays(report):
    greedy = report["sections"]["correctness"]["greedy_vs_transformers"]
    for run in ("graphs_off", "graphs_on"):
        assert greedy[run]["requests_matching"] == greedy[run]["requests"] > 0
    if greedy["graphs_on"]["backend"] == "cpu":  # an in-place backend: stubbed capture
        assert greedy["graphs_on"]["graph_replays"] > 0


def test_throughput_and_roofline_fields_are_positive(report):
    throughput = report["sections"]["throughput"]
    assert throughput["hbm_bandwidth"]["gb_per_s"] > 0
    assert "sdpa" in throughput
    attention = throughput["attention_decode"]  # triton in its interpreter vs SDPA
    assert attention["status"] == "ok" and attention["pass"] is True
    for name, entry in throughput.items():
        if name in ("model", "hbm_bandwidth", "attention_decode"):
            continue
        assert ("prefill" in entry) != name.endswith("_eager"), name
        for key in ("decode_b1", "decode_b4"):
            assert all(entry[key][f] > 0 for f in DECODE_FIELDS), (name, entry[key])
            assert 0 <= entry[key]["outside_forward_share"] < 1
            assert 0 < entry[key]["hbm_roofline_fraction"]
        if "prefill" in entry:
            assert entry["prefill"]["tokens_per_s"] > 0
    if "cpu" in throughput:  # the first in-place backend also runs with graphs off
        assert throughput["cpu_eager"]["graphs"] == "off"


def test_kv_sizing_serving_and_structured_output_fields(report):
    kv = report["sections"]["kv_sizing"]["kv_sizing"]
    assert kv["blocks"] == kv["arithmetic_blocks"] > 0
    served = report["sections"]["serving"]["served_vs_compute"]
    assert served["output_tokens_per_s"] > 0 and served["worker_compute_tokens_per_s"] > 0
    assert 0 < served["served_over_compute"] <= 1.05 and served["errors"] == 0
    structured = report["sections"]["serving"]["structured_output"]
    if structured["status"] == "ok":
        assert structured["none_tokens_per_s"] > 0 and structured["json_schema_tokens_per_s"] > 0


def test_the_plot_is_written_or_its_absence_said(report):
    plot = report["plot"]
    if "file" in plot:
        assert (report["_out"] / plot["file"]).stat().st_size > 0
    else:
        assert plot["skipped"]

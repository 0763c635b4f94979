"""Process settings the `server` CLI applies before it builds the engine."""

from __future__ import annotations

import sys

import pytest

from tokenbudget.server.entrypoints.cli import main


@pytest.fixture
def restore_switch_interval():
    interval = sys.getswitchinterval()
    yield
    sys.setswitchinterval(interval)


def test_gil_switch_interval_is_applied_before_the_engine_is_built(
    restore_switch_interval, tiny_model, capsys
):
    sys.setswitchinterval(0.005)
    # An impossible --max-model-len stops start-up right after the settings.
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["--model", tiny_model, "--gil-switch-interval-ms", "2", "--max-model-len", str(10**9)]
        )
    assert exit_info.value.code == 2
    assert "exceeds the model's max_position_embeddings" in capsys.readouterr().err
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_gil_switch_interval_must_be_positive(restore_switch_interval):
    with pytest.raises(SystemExit, match="--gil-switch-interval-ms must be > 0, got 0.0"):
        main(["--gil-switch-interval-ms", "0"])

"""The shape of the code (docs/architecture.md): small modules and functions,
a short scheduler step, layers that only import downwards.

Sizes come from Python's ast over the four package folders (generated
protobuf modules excluded)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "worker", "proto", "server")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
MAX_SCHEDULE_LINES = 20


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name)


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_hand_written_module_is_over_450_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules()}
    assert {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_no_function_is_over_60_lines():
    long = {
        f"{p.relative_to(ROOT)}:{f.name}": f.end_lineno - f.lineno + 1
        for p in _modules()
        for f in _functions(p)
        if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert long == {}


def test_the_scheduler_step_is_short_and_names_no_policy():
    path = ROOT / "core" / "sched" / "scheduler.py"
    (schedule,) = [f for f in _functions(path) if f.name == "schedule"]
    assert schedule.end_lineno - schedule.lineno + 1 <= MAX_SCHEDULE_LINES
    text = ast.get_source_segment(path.read_text(), schedule)
    for policy in ("fcfs", "priority", "lpm", "slo", "fair", "reserve", "_order"):
        assert policy not in text.lower(), policy


def _lint_imports(cwd: Path, env_path: Path | None = None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "lint-imports"
    env = None
    if env_path is not None:
        import os

        env = {**os.environ, "PYTHONPATH": str(env_path)}
    return subprocess.run(
        [str(exe), "--no-cache", str(cwd / "pyproject.toml")],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_imports_keep_to_the_layers():
    run = _lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize(
    "module, upward",
    [
        # A lazy import inside a function still counts.
        ("core/sched/scheduler.py", "def _up():\n    import tokenbudget.server.engine.core\n"),
        # So does one only made for type checkers.
        (
            "worker/sampler.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    import tokenbudget.server.executor\n",
        ),
    ],
)
def test_an_upward_import_breaks_the_layers_contract(tmp_path, module, upward):
    pkg = tmp_path / "tokenbudget"
    pkg.mkdir()
    shutil.copy(ROOT / "__init__.py", pkg / "__init__.py")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for folder in PACKAGES:
        shutil.copytree(
            ROOT / folder, pkg / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    target = pkg / module
    target.write_text(target.read_text() + "\n\n" + upward)
    run = _lint_imports(tmp_path, env_path=tmp_path)
    assert run.returncode != 0
    assert "BROKEN" in run.stdout and module.replace("/", ".")[:-3] in run.stdout

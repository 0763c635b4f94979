"""The built-in demo model: a tiny random-weight Qwen3, generated locally.

``server`` without ``--model`` serves it so a first run works offline. It is
built once into a cache folder (``~/.cache/tokenbudget/demo`` unless
``TOKENBUDGET_CACHE`` or ``--demo-dir`` says otherwise) and reused. Its
weights are random: the text it writes is gibberish, by design.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# Bump when the demo recipe changes so stale caches are rebuilt.
DEMO_VERSION = "1"


def default_demo_dir() -> Path:
    root = os.environ.get("TOKENBUDGET_CACHE") or Path.home() / ".cache" / "tokenbudget"
    return Path(root) / "demo"


def ensure_demo_model(path: str | os.PathLike | None = None) -> str:
    """Return the demo checkpoint folder, building it on first use."""
    target = Path(path) if path is not None else default_demo_dir()
    marker = target / "DEMO_VERSION"
    if marker.exists() and marker.read_text().strip() == DEMO_VERSION:
        return str(target)
    from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

    logger.warning("building the demo model (tiny Qwen3, RANDOM weights) into %s", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so concurrent first runs never see
    # a half-written checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        build_tiny_qwen3(tmp, seed=0)
        (tmp / "DEMO_VERSION").write_text(DEMO_VERSION + "\n")
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:
            if not marker.exists():  # another process won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)

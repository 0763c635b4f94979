"""Shared test setup: one torch thread (a busy 2-core box is 10-20x slower with more)."""
from __future__ import annotations

try:
    import torch
except ImportError:  # core-only environments
    torch = None

if torch is not None:
    torch.set_num_threads(1)

"""vLLM engine arguments that mean more here than a new name (those are
``ALIASES`` in args.py): how each is checked and where it takes effect.

- ``tokenizer_mode``: ``auto``, the fast (Rust) tokenizer, is the only one
  transformers 5 loads (it ignores ``use_fast=False``); vLLM's ``slow``,
  ``mistral`` and ``custom`` modes are refused.
- ``download_dir``: hub checkpoints are downloaded to and read from there
  (the Hugging Face cache directory of this process and the worker
  processes it starts).
- ``limit_mm_per_prompt``: the most items of each modality one prompt may
  carry; the input processor refuses more (images are all we take).
"""

from __future__ import annotations

import json
import os
from typing import Any

TOKENIZER_MODES = ("auto", "slow", "mistral", "custom")
MODALITIES = ("image", "video", "audio")


class UnsupportedArgument(ValueError):
    """An engine argument vLLM has whose value tokenbudget cannot honour."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"{name} is not supported: {why}")


def parse_mm_limits(value: str | dict[str, Any] | None) -> dict[str, int] | None:
    """``limit_mm_per_prompt`` as vLLM writes it (JSON text or a dict), e.g.
    ``{"image": 2}`` or ``{"image": {"count": 2}}``: modality -> count."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"limit_mm_per_prompt is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(
            f'limit_mm_per_prompt must be a JSON object such as {{"image": 2}}, got {value!r}'
        )
    limits: dict[str, int] = {}
    for modality, limit in value.items():
        if modality not in MODALITIES:
            raise ValueError(
                f"limit_mm_per_prompt: unknown modality {modality!r} (one of "
                f"{', '.join(MODALITIES)})"
            )
        count = limit.get("count") if isinstance(limit, dict) else limit
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(
                f"limit_mm_per_prompt.{modality} must be an integer >= 0, got {limit!r}"
            )
        limits[modality] = count
    return limits


def check_compat(args: Any) -> None:
    """Refuse, naming the setting, what these arguments cannot honour
    (``args``: EngineArgs, normalized in place)."""
    if args.tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(
            f"tokenizer_mode must be one of {', '.join(TOKENIZER_MODES)}, got "
            f"{args.tokenizer_mode!r}"
        )
    if args.tokenizer_mode != "auto":
        raise UnsupportedArgument(
            f"tokenizer_mode={args.tokenizer_mode!r}",
            "tokenizers load with transformers' "
            "AutoTokenizer, which has only the fast (Rust) ones; use 'auto'",
        )
    args.limit_mm_per_prompt = parse_mm_limits(args.limit_mm_per_prompt)


def use_download_dir(path: str | None) -> None:
    """Download hub checkpoints to and read them from ``path``: for this
    process (huggingface_hub reads its cache directory on each download)
    and the processes it starts (tensor-parallel ranks inherit the
    environment)."""
    if path is None:
        return
    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(path, exist_ok=True)
    os.environ["HF_HUB_CACHE"] = path
    from huggingface_hub import constants

    constants.HF_HUB_CACHE = path

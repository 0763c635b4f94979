"""Engine settings given as text: memory sizes ("2GiB") and chat templates
(a file or the template itself), parsed the way vLLM parses them.
EngineArgs (args.py) uses them; importable from there as before."""

from __future__ import annotations

import os
import re


def read_chat_template(template: str | None) -> str | None:
    """A chat template given inline or as the path of a file (vLLM's rule: an
    existing file is read, anything else is the template itself)."""
    if template is None:
        return None
    path = os.path.expanduser(template)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if "{" not in template:
        raise ValueError(f"chat_template: {template!r} is neither a file nor a Jinja template")
    return template


def parse_memory_size(value: int | str | None, name: str = "kv_cache_memory") -> int | None:
    """``1073741824``, ``"1GiB"``, ``"512MB"``, ``"2g"`` -> bytes."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", str(value).lower())
    if not m:
        raise ValueError(f"{name} must be a byte count or a size like '2GiB', got {value!r}")
    number, unit, suffix = m.groups()
    base = 1000 if suffix == "b" else 1024
    return int(float(number) * base ** " kmgt".index(unit or " "))

"""Where a checkpoint comes from (a local folder or a hub id), and one clear
line when it cannot be read.

transformers reads a name as a local folder when such a folder exists, and
as a Hugging Face hub id otherwise; its own errors then talk about repo-id
syntax or connections even when the user meant a path. We say which reading
was taken and what to do. No torch here: the server front uses it too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class ModelLoadError(ValueError):
    """A checkpoint (or its tokenizer, or its generation config) cannot be read.
    The message is one line naming the path or id, how it was read and what
    to do."""


def is_local(name: str) -> bool:
    return os.path.isdir(os.path.expanduser(name))


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def describe_failure(
    name: str,
    exc: BaseException,
    *,
    what: str = "model",
    flag: str = "--model",
    revision: str | None = None,
) -> str:
    """One line saying why ``what`` at ``name`` could not be loaded."""
    reason = " ".join(str(exc).split())
    if len(reason) > 300:
        reason = reason[:297] + "..."
    if is_local(name):
        if what == "model" and not os.path.isfile(
            os.path.join(os.path.expanduser(name), "config.json")
        ):
            reason = "it holds no config.json"
        return (
            f"cannot load {what} {name!r}: read as a local folder, but {reason} "
            f"(point {flag} to a folder saved with save_pretrained: config.json, weights, "
            "tokenizer files)"
        )
    looks_like_path = name.startswith((".", "/", "~")) or name.count("/") > 1
    text = reason.lower()
    if looks_like_path or "repo id must" in text or "repo_id" in text:
        return (
            f"cannot load {what} {name!r}: no such local folder, and not a valid Hugging "
            f"Face hub id (org/name) either; check the path given to {flag}"
        )
    at = f" at revision {revision!r}" if revision else ""
    head = (
        f"cannot load {what} {name!r}: there is no local folder of that name, so it was "
        f"read as a Hugging Face hub id{at}"
    )
    if _offline():
        return (
            f"{head}, which is not in the local cache, and HF_HUB_OFFLINE=1 forbids "
            f"downloading it; point {flag} to a local folder, or download it while online"
        )
    if "couldn't connect" in text or "connection" in text or "offline" in text:
        return (
            f"{head}, which is not in the local cache, and the hub cannot be reached; "
            f"point {flag} to a local folder, or download it while online"
        )
    if "revision" in text or "git identifier" in text:
        return f"{head}, which has no such revision; check --revision"
    if (
        "not a valid model identifier" in text
        or "repository not found" in text
        or "401" in text
        or "gated" in text
        or "404" in text
    ):
        return (
            f"{head}, which the hub does not have or does not let us read (a private or "
            "gated repository needs HF_TOKEN); check the name, or point "
            f"{flag} to a local folder"
        )
    return f"{head}, but reading it failed: {reason}"


def load_or_explain(
    load: Callable[[], T],
    name: str,
    *,
    what: str = "model",
    flag: str = "--model",
    revision: str | None = None,
) -> T:
    """``load()``, turning transformers' loading errors into a ModelLoadError."""
    try:
        return load()
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(
            describe_failure(name, exc, what=what, flag=flag, revision=revision)
        ) from None


def load_config(model: str, *, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The checkpoint's transformers config, or a ModelLoadError."""
    from transformers import AutoConfig

    return load_or_explain(
        lambda: AutoConfig.from_pretrained(
            model, revision=revision, trust_remote_code=trust_remote_code
        ),
        model,
        revision=revision,
    )

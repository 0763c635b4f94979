"""A model's default pooling (``PoolerConfig``) for embedding requests.

In order: the engine setting ``pooler_config`` (vLLM's ``--pooler-config``),
field by field; the checkpoint's sentence-transformers files (``modules.json``
naming a ``Pooling`` module whose ``config.json`` sets the mode, and a
``Normalize`` module); else by architecture: every model tokenbudget serves is
a decoder, embedded as Qwen3-Embedding and vLLM's decoder embedders are: the
last token's hidden state, L2-normalised.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from tokenbudget.core.pooling_params import PoolerConfig

logger = logging.getLogger(__name__)

# sentence-transformers' Pooling config keys -> our pooling type.
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}


def load_pooler_config(
    model: str, override: dict | str | None = None, *, revision: str | None = None
) -> PoolerConfig:
    """The default pooling of ``model`` (a local folder or hub id), with the
    fields of ``override`` (a dict or its JSON text) taking precedence."""
    fields = _sentence_transformers_fields(model, revision)
    source = "the checkpoint's sentence-transformers config" if fields else "the architecture"
    fields.update(PoolerConfig.overrides(override))
    config = PoolerConfig(**fields)
    logger.debug(
        "pooling default for %s: %s (from %s%s)",
        model,
        config,
        source,
        ", overridden by pooler_config" if override else "",
    )
    return config


def is_embedding_checkpoint(model: str, *, revision: str | None = None) -> bool:
    """Whether ``model`` is an embedding model by its checkpoint: its
    sentence-transformers files name a Pooling module (Qwen3-Embedding and the
    like, whose architecture is still ``*ForCausalLM``). vLLM's runner "auto"
    serves such a checkpoint as a pooling model, and SGLang reports
    ``is_generation=False`` for an embedding model; ``--pooler-config`` alone
    does not make one (it only changes how embedding requests pool)."""
    return "pooling_type" in _sentence_transformers_fields(model, revision)


def _sentence_transformers_fields(model: str, revision: str | None) -> dict[str, Any]:
    modules = _read_json(model, "modules.json", revision)
    if not isinstance(modules, list):
        return {}
    fields: dict[str, Any] = {}
    for module in modules:
        if not isinstance(module, dict):
            continue
        kind = str(module.get("type", ""))
        if kind.endswith(".Pooling"):
            config = (
                _read_json(model, f"{module.get('path', '')}/config.json".lstrip("/"), revision)
                or {}
            )
            mode = next((ours for key, ours in _ST_MODES.items() if config.get(key)), None)
            if mode is None:
                raise ValueError(
                    f"model {model!r}: its sentence-transformers Pooling config "
                    f"sets no mode we support ({', '.join(_ST_MODES)}); pass "
                    'pooler_config=\'{"pooling_type": "LAST"}\' to choose one'
                )
            fields["pooling_type"] = mode
        elif kind.endswith(".Normalize"):
            fields["normalize"] = True
    if "pooling_type" in fields:
        fields.setdefault("normalize", False)  # sentence-transformers normalises only by module
    return fields


def _read_json(model: str, filename: str, revision: str | None) -> Any:
    """A JSON file of the checkpoint, or None when it has none."""
    from transformers.utils import cached_file

    try:
        path = cached_file(
            model,
            filename,
            revision=revision,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
        )
    except OSError:
        return None
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)

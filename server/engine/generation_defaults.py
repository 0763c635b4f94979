"""What a checkpoint's generation_config.json says about generating: its EOS
ids, and the sampling defaults vLLM applies to requests that leave a field
unset (``generation_config="auto"``, vLLM's default).

Core stays model-agnostic: ``SamplingParams`` keeps its own defaults, and the
fronts fill in these values where a request did not choose (unset proto
fields over gRPC; ``sampling_params=None`` in ``LLM.generate``, as vLLM's
``LLM.get_default_sampling_params``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from tokenbudget.core.sampling_params import SamplingParams

logger = logging.getLogger("tokenbudget.server")

# generation_config.json field -> SamplingParams field: the ones vLLM takes.
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(slots=True)
class GenerationDefaults:
    eos_token_ids: list[int] = field(default_factory=list)
    # SamplingParams keyword -> the checkpoint's value, for fields it sets.
    sampling: dict[str, Any] = field(default_factory=dict)

    def sampling_params(self) -> SamplingParams:
        """The SamplingParams of a request that chose nothing."""
        return SamplingParams(**self.sampling)


def load_generation_defaults(
    model: str,
    *,
    source: str = "auto",
    revision: str | None = None,
    tokenizer_eos_token_id: int | None = None,
) -> GenerationDefaults:
    """``source``: "auto" (the model's file), "vllm" (no sampling defaults) or
    a folder holding a generation_config.json. EOS ids always come from the
    model's file (may be a list), else the tokenizer's EOS."""
    own = _read(model, revision)
    eos = own.get("eos_token_id", tokenizer_eos_token_id)
    eos_ids = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    if source == "vllm":
        return GenerationDefaults(eos_ids)
    values = own if source == "auto" else _read(source, None, required=True)
    sampling = {
        ours: values[theirs]
        for theirs, ours in SAMPLING_FIELDS.items()
        if values.get(theirs) is not None
    }
    if sampling:
        try:  # a bad value in the file is the checkpoint's problem: say whose
            SamplingParams(**sampling)
        except ValueError as exc:
            raise ValueError(
                f"generation_config of {source if source != 'auto' else model!r} "
                f"has a sampling default we cannot use: {exc}; pass "
                "generation_config='vllm' to ignore it"
            ) from None
        logger.info(
            "sampling defaults from the model's generation_config.json (requests "
            "override them; --generation-config vllm ignores them): %s",
            ", ".join(f"{k}={v}" for k, v in sampling.items()),
        )
    return GenerationDefaults(eos_ids, sampling)


def _read(path: str, revision: str | None, *, required: bool = False) -> dict[str, Any]:
    """The fields the file sets (none when there is no file, unless required)."""
    from transformers import GenerationConfig

    if required and not os.path.isfile(
        os.path.join(os.path.expanduser(path), "generation_config.json")
    ):
        raise ValueError(f"generation_config: {path!r} holds no generation_config.json")
    try:
        return GenerationConfig.from_pretrained(path, revision=revision).to_diff_dict()
    except OSError:  # no generation_config.json: nothing to take
        return {}

"""What a request must satisfy to enter the scheduler: refused on arrival
(ValueError, to its client) rather than failing or blocking the queue later."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenbudget.core.config import SchedulerConfig
    from tokenbudget.core.request import Request


def check_request(
    request: Request,
    config: SchedulerConfig,
    pool_tokens: int,
    structured_output: bool,
    lora_enabled: bool = False,
) -> None:
    """Raise ValueError if ``request`` can never run: longer than
    max_model_len or than the whole KV cache (``pool_tokens``), a multimodal
    item the encoder cannot take, or structured output on an engine without
    it (``structured_output``), or a LoRA adapter on an engine without LoRA
    (``lora_enabled``)."""
    if request.num_tokens > config.max_model_len:
        raise ValueError(
            f"prompt has {request.num_tokens} tokens, more than "
            f"max_model_len={config.max_model_len}"
        )
    if request.num_tokens + config.num_speculative_tokens > pool_tokens:
        # It could never be admitted and would block the queue behind it.
        raise ValueError(
            f"prompt has {request.num_tokens} tokens but the KV cache holds "
            f"only {pool_tokens}; raise num_gpu_blocks or shorten the prompt"
        )
    limit = min(config.encoder_cache_size, config.encoder_compute_budget)
    for f in request.mm_features:
        if f.length > limit:
            raise ValueError(
                f"multimodal item {f.mm_hash} needs {f.length} encoder embeddings, more than "
                f"the encoder cache/budget allows ({limit}); use a smaller image or raise "
                "encoder_cache_size"
            )
        if f.offset + f.length > request.num_prompt_tokens:
            raise ValueError(
                f"multimodal item {f.mm_hash} placeholder "
                f"[{f.offset}, {f.offset + f.length}) lies outside the prompt"
            )
    if request.sampling_params.structured is not None and not structured_output:
        raise ValueError("structured output is not enabled on this engine")
    if request.lora_request is not None and not lora_enabled:
        raise ValueError(
            f"request {request.request_id}: LoRA adapter {request.lora_request.lora_name!r} "
            "asked for but LoRA is not enabled (enable_lora)"
        )

"""Load a Hugging Face checkpoint with transformers, wired to our paged attention."""

from __future__ import annotations

import torch

from tokenbudget.worker.attention import PAGED_ATTENTION, register_paged_attention
from tokenbudget.core.utils.model_source import load_config, load_or_explain

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_dtype(dtype: str | torch.dtype, config, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU; on GPU the checkpoint's half dtype, else bfloat16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        saved = _DTYPES.get(saved, saved) if isinstance(saved, str) else saved
        return saved if saved in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def check_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> None:
    """vLLM's ``kv_cache_dtype``: ``auto`` (the model's dtype) or that same dtype
    by name; the cache is always kept in the model's dtype."""
    if kv_cache_dtype == "auto" or _DTYPES.get(kv_cache_dtype) == model_dtype:
        return
    name = str(model_dtype).removeprefix("torch.")
    raise ValueError(
        f"kv_cache_dtype={kv_cache_dtype!r} is not supported: the KV cache is "
        f"kept in the model's dtype ({name}); use kv_cache_dtype='auto', or set "
        "dtype to change both"
    )


def is_vision_language_config(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def load_model(
    model: str,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    revision: str | None = None,
) -> torch.nn.Module:
    """from_pretrained (local folder or hub id), eval mode, decoder attention paged.

    Only the causal decoder's attention goes through the paged function; a
    vision tower keeps sdpa because it attends bidirectionally within an image
    and has no KV cache. What the paged function cannot run exactly is refused
    here (``check_supported``), before the weights are read.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    device = torch.device(device)
    config = load_config(model, revision=revision, trust_remote_code=trust_remote_code)
    check_supported(config, model)
    auto_cls = (
        AutoModelForImageTextToText if is_vision_language_config(config) else AutoModelForCausalLM
    )
    # transformers refuses sdpa for soft-capped models (Gemma-2); the decoder is paged anyway.
    softcap = getattr(config.get_text_config(), "attn_logit_softcapping", None)
    net = load_or_explain(
        lambda: auto_cls.from_pretrained(
            model,
            dtype=resolve_dtype(dtype, config, device),
            attn_implementation="eager" if softcap else "sdpa",
            trust_remote_code=trust_remote_code,
            revision=revision,
        ),
        model,
        revision=revision,
    )
    net = net.to(device).eval().requires_grad_(False)
    use_paged_attention(net)
    return net


def decoder_kv_shape(text_config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder's KV cache, from any
    transformers config: the attribute maps of older configs (GPT-2's
    ``n_layer``/``n_head``/``n_embd``) answer to the standard names; no
    ``num_key_value_heads`` means multi-head attention (as many KV heads as
    query heads); no ``head_dim`` means hidden_size / num_attention_heads."""
    c = text_config
    num_heads = c.num_attention_heads
    num_kv_heads = (
        getattr(c, "num_key_value_heads", None) or getattr(c, "num_kv_heads", None) or num_heads
    )
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // num_heads
    return int(c.num_hidden_layers), int(num_kv_heads), int(head_dim)


def check_supported(config, model: str) -> None:
    """Refuse, with the reason, checkpoints the paged decoder cannot run exactly.

    Sliding windows and attention soft-capping run exactly: each window has
    its own KV cache group (worker/kv_groups.py).
    """
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"model {model!r} ({type(config).__name__}) is an encoder-decoder; "
            "tokenbudget serves decoder-only models"
        )
    text_config = config.get_text_config()
    for name in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if getattr(text_config, name, None) is None:
            raise ValueError(
                f"model {model!r} ({type(config).__name__}): its config has no "
                f"{name}; not a decoder tokenbudget knows how to page"
            )


def use_paged_attention(net: torch.nn.Module) -> None:
    """Switch the causal decoder layers' config to the paged attention function.

    Decoder attention modules are the causal ones with a ``layer_idx``; they
    share one text config object, so setting it once per distinct config
    reaches every layer (and the mask builder, which then skips its masks).
    """
    register_paged_attention()
    configs = {
        id(m.config): m.config
        for m in net.modules()
        if getattr(m, "is_causal", False) and hasattr(m, "layer_idx") and hasattr(m, "config")
    }
    if not configs:
        raise ValueError(f"{type(net).__name__}: found no causal attention layers to page")
    for config in configs.values():
        config._attn_implementation = PAGED_ATTENTION

"""Load a Hugging Face checkpoint with transformers, wired to our paged attention."""
from __future__ import annotations

import torch

from tokenbudget.worker.attention import PAGED_ATTENTION, register_paged_attention

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16}


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


def is_vision_language_config(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def load_model(model: str, *, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               trust_remote_code: bool = False) -> torch.nn.Module:
    """from_pretrained (local folder or hub id), eval mode, decoder attention paged.

    Only the causal decoder's attention goes through the paged function; a
    vision tower keeps sdpa because it attends bidirectionally within an image
    and has no KV cache.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    device = torch.device(device)
    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    auto_cls = AutoModelForImageTextToText if is_vision_language_config(config) else AutoModelForCausalLM
    net = auto_cls.from_pretrained(model, dtype=resolve_dtype(dtype, config, device),
                                   attn_implementation="sdpa", trust_remote_code=trust_remote_code)
    net = net.to(device).eval().requires_grad_(False)
    use_paged_attention(net)
    return net


def use_paged_attention(net: torch.nn.Module) -> None:
    """Switch the causal decoder layers' config to the paged attention function.

    Decoder attention modules are the causal ones with a ``layer_idx``; they
    share one text config object, so setting it once per distinct config
    reaches every layer (and the mask builder, which then skips its masks).
    """
    register_paged_attention()
    configs = {id(m.config): m.config for m in net.modules()
               if getattr(m, "is_causal", False) and hasattr(m, "layer_idx") and hasattr(m, "config")}
    if not configs:
        raise ValueError(f"{type(net).__name__}: found no causal attention layers to page")
    for config in configs.values():
        config._attn_implementation = PAGED_ATTENTION

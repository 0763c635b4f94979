"""Tiny random-init Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints for tests and demos.

Each builder writes a folder that loads through the real path
(``AutoModelForImageTextToText.from_pretrained`` / ``AutoTokenizer`` /
``Qwen2VLImageProcessorPil``): config + float32 weights + the locally trained
tokenizer + an image processor config. Images are resized to at most
``_MAX_MERGED_TOKENS`` merged tokens so a prompt with an image stays short.
"""

from __future__ import annotations

from pathlib import Path

_MAX_MERGED_TOKENS = 16
_MIN_MERGED_TOKENS = 4
_MERGE = 2


def build_tiny_qwen2_vl(path: str | Path, *, seed: int = 0) -> str:
    """Write a tiny Qwen2-VL (2 text layers, vision depth 2 with full attention
    in every block) to ``path`` and return it."""
    from transformers import Qwen2VLConfig

    def make_config(ids: dict[str, int]) -> Qwen2VLConfig:
        text = dict(
            vocab_size=ids["vocab_size"],
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [4, 6, 6],
            },
            bos_token_id=None,
            eos_token_id=ids["eos"],
            pad_token_id=ids["pad"],
        )
        # Qwen2-VL's tower names its width embed_dim; hidden_size is its output
        # (the text model's width).
        vision = dict(
            depth=2,
            embed_dim=32,
            mlp_ratio=2,
            num_heads=2,
            hidden_size=128,
            patch_size=14,
            spatial_merge_size=_MERGE,
            temporal_patch_size=2,
        )
        return Qwen2VLConfig(text_config=text, vision_config=vision, **_vision_token_ids(ids))

    return _build(
        Path(path),
        make_config,
        patch_size=14,
        image_mean=_CLIP_MEAN,
        image_std=_CLIP_STD,
        seed=seed,
    )


def build_tiny_qwen2_5_vl(path: str | Path, *, seed: int = 0) -> str:
    """Write a tiny Qwen2.5-VL (2 text layers, vision depth 2 with one windowed
    and one full-attention block) to ``path`` and return it."""
    from transformers import Qwen2_5_VLConfig

    def make_config(ids: dict[str, int]) -> Qwen2_5_VLConfig:
        text = dict(
            vocab_size=ids["vocab_size"],
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            # head_dim 32 -> 16 rotary frequencies split over (t, h, w).
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [4, 6, 6],
            },
            # The stock default bos id (151643) lies outside a tiny vocab.
            bos_token_id=None,
            eos_token_id=ids["eos"],
            pad_token_id=ids["pad"],
        )
        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=_MERGE,
            temporal_patch_size=2,
            out_hidden_size=128,
            # A window of 2x2 merged tokens: block 0 is windowed, block 1 sees the
            # whole image, so both attention paths of the tower are exercised.
            window_size=56,
            fullatt_block_indexes=[1],
            tokens_per_second=2,
        )
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_vision_token_ids(ids))

    return _build(
        Path(path),
        make_config,
        patch_size=14,
        image_mean=_CLIP_MEAN,
        image_std=_CLIP_STD,
        seed=seed,
    )


def build_tiny_qwen3_vl(path: str | Path, *, seed: int = 0) -> str:
    """Write a tiny Qwen3-VL (2 text layers, vision depth 2, deepstack features
    from both vision blocks feeding text layers 0 and 1) to ``path``."""
    from transformers import Qwen3VLConfig

    def make_config(ids: dict[str, int]) -> Qwen3VLConfig:
        text = dict(
            vocab_size=ids["vocab_size"],
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
            },
            pad_token_id=ids["pad"],
        )
        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=_MERGE,
            temporal_patch_size=2,
            out_hidden_size=128,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1],
        )
        return Qwen3VLConfig(text_config=text, vision_config=vision, **_vision_token_ids(ids))

    return _build(
        Path(path),
        make_config,
        patch_size=16,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        seed=seed,
    )


_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _vision_token_ids(ids: dict[str, int]) -> dict[str, int]:
    return {
        k: ids[k]
        for k in (
            "image_token_id",
            "video_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
        )
    }


def _build(
    path: Path,
    make_config,
    *,
    patch_size: int,
    image_mean: list[float],
    image_std: list[float],
    seed: int,
) -> str:
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tokenbudget.server.testing.tiny_models import build_tokenizer

    tokenizer = build_tokenizer(path)
    ids = _token_ids(tokenizer)
    config = make_config(ids)

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=ids["eos"], pad_token_id=ids["pad"], do_sample=False
    )
    model.save_pretrained(path)

    unit = patch_size * _MERGE  # one merged token covers unit x unit pixels
    Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        merge_size=_MERGE,
        temporal_patch_size=2,
        min_pixels=_MIN_MERGED_TOKENS * unit * unit,
        max_pixels=_MAX_MERGED_TOKENS * unit * unit,
        image_mean=image_mean,
        image_std=image_std,
    ).save_pretrained(path)
    return str(path)


def _token_ids(tokenizer) -> dict[str, int]:
    from tokenbudget.server.testing.tiny_models import padded_vocab_size

    def tid(token: str) -> int:
        i = tokenizer.convert_tokens_to_ids(token)
        if i is None or i == tokenizer.unk_token_id:
            raise ValueError(f"tokenizer lacks the special token {token!r}")
        return i

    return {
        "vocab_size": padded_vocab_size(len(tokenizer)),
        "image_token_id": tid("<|image_pad|>"),
        "video_token_id": tid("<|video_pad|>"),
        "vision_start_token_id": tid("<|vision_start|>"),
        "vision_end_token_id": tid("<|vision_end|>"),
        "eos": tid("<|im_end|>"),
        "pad": tid("<|endoftext|>"),
    }


def hf_generate_vl(
    path: str | Path, messages: list[dict], max_new_tokens: int, *, ignore_eos: bool = False
) -> list[int]:
    """Greedy ``transformers`` generate() on a chat with images: the oracle the
    runner's VL tests compare against. Returns the new token ids."""
    import torch
    from transformers import AutoModelForImageTextToText

    from tokenbudget.server.engine.mm_processor import MultiModalProcessor

    prompt_ids, features = MultiModalProcessor.from_pretrained(str(path)).process_messages(messages)
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    return hf_generate_vl_ids(model, prompt_ids, features, max_new_tokens, ignore_eos=ignore_eos)


def hf_generate_vl_ids(
    model,
    prompt_token_ids: list[int],
    mm_features: list,
    max_new_tokens: int,
    *,
    ignore_eos: bool = False,
) -> list[int]:
    """Like ``hf_generate_vl`` for a loaded model and processed prompt."""
    import torch

    from tokenbudget.worker.vision import mm_token_type_ids

    kwargs: dict = {}
    if mm_features:
        kwargs = dict(
            pixel_values=torch.cat([f.data["pixel_values"] for f in mm_features]),
            image_grid_thw=torch.cat([f.data["image_grid_thw"] for f in mm_features]),
            mm_token_type_ids=mm_token_type_ids(len(prompt_token_ids), mm_features),
        )
    if ignore_eos:
        kwargs["eos_token_id"] = None
    input_ids = torch.tensor([prompt_token_ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **kwargs,
        )
    return out[0, len(prompt_token_ids) :].tolist()


def random_png(height: int, width: int, seed: int) -> bytes:
    """A random RGB image of the given size, PNG-encoded (test and demo input)."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()

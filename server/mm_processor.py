"""Chat messages with images -> prompt token ids + MultiModalFeatures (Qwen-VL).

The stock ``Qwen*VLProcessor`` needs torchvision (for its video processor), so
this uses the checkpoint's tokenizer and PIL image processor directly: the chat
template renders each image part as ``<|vision_start|><|image_pad|><|vision_end|>``
and the single ``<|image_pad|>`` is expanded here to the image's number of
embeddings, ``t * h * w / merge_size**2`` of its ``image_grid_thw``.
"""
from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from typing import Any

from tokenbudget.core.request import MultiModalFeature

IMAGE_PAD = "<|image_pad|>"


class MultiModalProcessor:
    def __init__(self, tokenizer: Any, image_processor: Any) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token_id: int = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {IMAGE_PAD} token")
        self.merge_size: int = image_processor.merge_size

    @classmethod
    def from_pretrained(cls, path: str) -> MultiModalProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        # PIL on every machine: torchvision may be missing, and one backend
        # everywhere keeps pixel values (and thus outputs) identical.
        return cls(AutoTokenizer.from_pretrained(path),
                   AutoImageProcessor.from_pretrained(path, backend="pil"))

    def process_messages(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """OpenAI-style ``messages`` (content a string or a list of
        ``{"type": "text", "text": ...}`` / ``{"type": "image", "image": bytes | PIL.Image}``
        parts) -> (prompt token ids, one feature per image in prompt order)."""
        images = [(f"messages[{i}].content[{j}].image", part.get("image"))
                  for i, j, part in _content_parts(messages) if part["type"] == "image"]
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self._expand(token_ids, images, field="messages")

    def process_prompt(
        self, prompt: str | Sequence[int], images: Sequence[Any],
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """A prompt already holding one ``<|image_pad|>`` per image (text or token ids)."""
        token_ids = (self.tokenizer.encode(prompt, add_special_tokens=False)
                     if isinstance(prompt, str) else list(prompt))
        return self._expand(token_ids, [(f"images[{i}]", im) for i, im in enumerate(images)],
                            field="prompt")

    def _expand(self, token_ids: list[int], images: list[tuple[str, Any]],
                field: str) -> tuple[list[int], list[MultiModalFeature]]:
        placeholders = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(placeholders) != len(images):
            raise ValueError(f"{field}: {len(images)} image(s) but the prompt has "
                             f"{len(placeholders)} {IMAGE_PAD} placeholder(s)")
        out: list[int] = []
        features: list[MultiModalFeature] = []
        prev = 0
        for pos, (name, image) in zip(placeholders, images):
            pil, mm_hash = _load_image(name, image)
            try:
                data = self.image_processor(images=[pil], return_tensors="pt")
            except ValueError as e:  # e.g. an aspect ratio the resizer refuses
                raise ValueError(f"{name}: {e}") from None
            grid = data["image_grid_thw"]
            length = int(grid.prod()) // self.merge_size**2
            out.extend(token_ids[prev:pos])
            features.append(MultiModalFeature(
                mm_hash=mm_hash, offset=len(out), length=length,
                data={"pixel_values": data["pixel_values"], "image_grid_thw": grid}))
            out.extend([self.image_token_id] * length)
            prev = pos + 1
        out.extend(token_ids[prev:])
        return out, features


def _content_parts(messages: Sequence[dict[str, Any]]):
    """Yield (message index, part index, part) for list contents, validating types."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise ValueError(f"messages[{i}].content: expected a string or a list of parts, "
                             f"got {type(content).__name__}")
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "image"):
                raise ValueError(f"messages[{i}].content[{j}].type: expected 'text' or 'image', "
                                 f"got {kind!r}")
            yield i, j, part


def _load_image(name: str, image: Any):
    """(PIL image, sha256 hex of its content) for raw bytes or a PIL image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        digest = hashlib.sha256(f"{image.mode}:{image.size}:".encode())
        digest.update(image.tobytes())
        return image, digest.hexdigest()
    if not isinstance(image, (bytes, bytearray, memoryview)):
        raise ValueError(f"{name}: expected image bytes or a PIL image, "
                         f"got {type(image).__name__}")
    raw = bytes(image)
    try:
        pil = Image.open(io.BytesIO(raw))
        pil.load()  # decode now: open() only reads the header
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as e:
        raise ValueError(f"{name}: cannot decode image bytes ({e})") from None
    return pil, hashlib.sha256(raw).hexdigest()

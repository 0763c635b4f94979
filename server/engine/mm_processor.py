"""Chat messages with images -> prompt token ids + MultiModalFeatures (Qwen-VL).

The stock ``Qwen*VLProcessor`` needs torchvision (for its video processor), so
this uses the checkpoint's tokenizer and PIL image processor directly: the chat
template renders each image part as ``<|vision_start|><|image_pad|><|vision_end|>``
and the single ``<|image_pad|>`` is expanded here to the image's number of
embeddings, ``t * h * w / merge_size**2`` of its ``image_grid_thw``.

Image sizes are checked from the file's header before anything is decoded:
the image processor resizes every image to at most its ``max_pixels`` (the
checkpoint's ``size.longest_edge``, 12845056 for Qwen2.5-VL), but decoding
comes first and costs about 10 bytes per source pixel, so a 519 KB PNG of
13000x13000 would take 1.6 GB and seconds before the resize. An image over
``max_image_pixels``, or images adding up to more than
``max_image_pixels_per_request``, are refused without decoding any of them.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Sequence
from typing import Any

from tokenbudget.core.request import MultiModalFeature

IMAGE_PAD = "<|image_pad|>"
# 4096 x 4096: a 12 MP phone photo passes; decoding one costs about 170 MB.
DEFAULT_MAX_IMAGE_PIXELS = 1 << 24
DEFAULT_MAX_IMAGE_PIXELS_PER_REQUEST = 1 << 26


class MultiModalProcessor:
    """``encode(text, field)``: how a rendered prompt becomes token ids
    (default: the tokenizer's ``encode`` without special tokens; the
    InputProcessor passes its own, which refuses a prompt too long to
    tokenize, naming ``field``)."""

    def __init__(
        self,
        tokenizer: Any,
        image_processor: Any,
        *,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        max_image_pixels_per_request: int = DEFAULT_MAX_IMAGE_PIXELS_PER_REQUEST,
        max_images_per_prompt: int | None = None,
        encode: Callable[[str, str], list[int]] | None = None,
    ) -> None:
        for name, value in (
            ("max_image_pixels", max_image_pixels),
            ("max_image_pixels_per_request", max_image_pixels_per_request),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.max_image_pixels = max_image_pixels
        self.max_image_pixels_per_request = max_image_pixels_per_request
        # limit_mm_per_prompt's image count (None: no limit).
        self.max_images_per_prompt = max_images_per_prompt
        self._encode = encode or (
            lambda text, field: tokenizer.encode(text, add_special_tokens=False)
        )
        self.image_token_id: int = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {IMAGE_PAD} token")
        self.merge_size: int = image_processor.merge_size

    @classmethod
    def from_pretrained(cls, path: str, **limits: Any) -> MultiModalProcessor:
        """``limits``: the keywords of ``__init__`` (pixel limits, ``encode``)."""
        from transformers import AutoImageProcessor, AutoTokenizer

        # PIL on every machine: torchvision may be missing, and one backend
        # everywhere keeps pixel values (and thus outputs) identical.
        return cls(
            AutoTokenizer.from_pretrained(path),
            AutoImageProcessor.from_pretrained(path, backend="pil"),
            **limits,
        )

    def process_messages(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """OpenAI-style ``messages`` (content a string or a list of
        ``{"type": "text", "text": ...}`` / ``{"type": "image", "image": bytes | PIL.Image}``
        parts) -> (prompt token ids, one feature per image in prompt order)."""
        images = [
            (f"messages[{i}].content[{j}].image", part.get("image"))
            for i, j, part in _content_parts(messages)
            if part["type"] == "image"
        ]
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return self._expand(self._encode(text, "messages"), images, field="messages")

    def process_prompt(
        self, prompt: str | Sequence[int], images: Sequence[Any]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """A prompt already holding one ``<|image_pad|>`` per image (text or token ids)."""
        token_ids = self._encode(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
        return self._expand(
            token_ids, [(f"images[{i}]", im) for i, im in enumerate(images)], field="prompt"
        )

    def _expand(
        self, token_ids: list[int], images: list[tuple[str, Any]], field: str
    ) -> tuple[list[int], list[MultiModalFeature]]:
        limit = self.max_images_per_prompt
        if limit is not None and len(images) > limit:
            raise ValueError(
                f"{field}: {len(images)} images, more than the server's "
                f"limit_mm_per_prompt of {limit} per prompt"
            )
        placeholders = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(placeholders) != len(images):
            raise ValueError(
                f"{field}: {len(images)} image(s) but the prompt has "
                f"{len(placeholders)} {IMAGE_PAD} placeholder(s)"
            )
        opened = self._open_all(images)
        out: list[int] = []
        features: list[MultiModalFeature] = []
        prev = 0
        for pos, (name, _), (pil, mm_hash) in zip(placeholders, images, opened):
            _decode(name, pil)
            try:
                data = self.image_processor(images=[pil], return_tensors="pt")
            except ValueError as e:  # e.g. an aspect ratio the resizer refuses
                raise ValueError(f"{name}: {e}") from None
            grid = data["image_grid_thw"]
            length = int(grid.prod()) // self.merge_size**2
            out.extend(token_ids[prev:pos])
            features.append(
                MultiModalFeature(
                    mm_hash=mm_hash,
                    offset=len(out),
                    length=length,
                    data={"pixel_values": data["pixel_values"], "image_grid_thw": grid},
                )
            )
            out.extend([self.image_token_id] * length)
            prev = pos + 1
        out.extend(token_ids[prev:])
        return out, features

    def _open_all(self, images: list[tuple[str, Any]]) -> list[tuple[Any, str]]:
        """Every image opened (headers read, nothing decoded) and its size
        checked against the limits."""
        opened, total = [], 0
        for name, image in images:
            pil = _open_image(name, image, self.max_image_pixels)
            width, height = pil.size
            pixels = width * height
            if pixels > self.max_image_pixels:
                raise ValueError(
                    f"{name}: the image is {width}x{height} = {pixels} pixels, more "
                    f"than max_image_pixels={self.max_image_pixels} (the server's "
                    "limit); send it smaller"
                )
            total += pixels
            if total > self.max_image_pixels_per_request:
                raise ValueError(
                    f"{name}: the request's images add up to more than "
                    f"max_image_pixels_per_request="
                    f"{self.max_image_pixels_per_request} pixels (the server's "
                    f"limit; {total} with this one); send fewer or smaller images"
                )
            opened.append((pil, _content_hash(image, pil)))
        return opened


def _content_parts(messages: Sequence[dict[str, Any]]):
    """Yield (message index, part index, part) for list contents, validating types."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise ValueError(
                f"messages[{i}].content: expected a string or a list of parts, "
                f"got {type(content).__name__}"
            )
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "image"):
                raise ValueError(
                    f"messages[{i}].content[{j}].type: expected 'text' or 'image', got {kind!r}"
                )
            yield i, j, part


def _open_image(name: str, image: Any, max_pixels: int):
    """A PIL image for raw bytes (opened: PIL has read the header, nothing is
    decoded) or the PIL image given."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image
    if not isinstance(image, (bytes, bytearray, memoryview)):
        raise ValueError(f"{name}: expected image bytes or a PIL image, got {type(image).__name__}")
    try:
        return Image.open(io.BytesIO(image))
    except UnidentifiedImageError:
        raise ValueError(
            f"{name}: cannot decode: not an image file PIL can read (PNG, "
            "JPEG, WebP, GIF, BMP, ...)"
        ) from None
    except Image.DecompressionBombError:  # PIL's own limit, above ours unless raised
        raise ValueError(
            f"{name}: the image has more than max_image_pixels={max_pixels} "
            "pixels (the server's limit); send it smaller"
        ) from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{name}: cannot read the image ({e})") from None


def _content_hash(image: Any, pil: Any) -> str:
    """sha256 hex of the bytes sent, or of a PIL image's mode, size and pixels."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return hashlib.sha256(image).hexdigest()
    digest = hashlib.sha256(f"{pil.mode}:{pil.size}:".encode())
    digest.update(pil.tobytes())
    return digest.hexdigest()


def _decode(name: str, pil: Any) -> None:
    """Decode an opened image (a truncated or corrupt file fails here)."""
    from PIL import Image

    try:
        pil.load()
    except (Image.DecompressionBombError, OSError, ValueError, SyntaxError) as e:
        raise ValueError(f"{name}: cannot decode the image ({e})") from None

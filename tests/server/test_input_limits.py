"""One client cannot exhaust the server's memory (issue 10, defect 9): images
are refused from their headers before decoding, a text prompt that cannot
fit is refused before tokenizing (with truncate_prompt_tokens only its tail
is tokenized), max_tokens is clamped to the context, and compiled grammars
are cached within a byte bound."""

from __future__ import annotations

import io

import pytest
from PIL import Image, ImageFile

from tokenbudget.core.sampling_params import SamplingParams, StructuredOutputParams
from tokenbudget.server.engine.input_processor import InputProcessor
from tokenbudget.server.engine.request_builder import build_requests


def _png(width: int, height: int, mode: str = "RGB") -> bytes:
    """A real PNG; mode "1" keeps a huge one cheap to make (1 bit a pixel, compresses to KB)."""
    buf = io.BytesIO()
    Image.new(mode, (width, height)).save(buf, format="PNG")
    return buf.getvalue()


def _chat(*images: bytes) -> dict:
    parts = [{"type": "text", "text": "look"}] + [{"type": "image", "image": im} for im in images]
    return {"messages": [{"role": "user", "content": parts}]}


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory) -> str:
    from tokenbudget.server.testing.tiny_vl_models import build_tiny_qwen2_5_vl

    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny_vl_limits"), seed=0)


@pytest.fixture
def decodes(monkeypatch) -> list[tuple[int, int]]:
    """The sizes of the images PIL decodes (ImageFile.load), in order, once per image."""
    seen: list[tuple[int, int]] = []
    loaded: set[int] = set()
    load = ImageFile.ImageFile.load

    def recording_load(self):
        if id(self) not in loaded:
            loaded.add(id(self))
            seen.append(self.size)
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", recording_load)
    return seen


def test_a_13000_square_png_is_refused_from_its_header_without_decoding(vl_path, decodes):
    bomb = _png(13000, 13000, mode="1")
    assert len(bomb) < 600_000  # small on the wire, 507 MB decoded as RGB
    processor = InputProcessor.from_pretrained(vl_path)
    with pytest.raises(
        ValueError,
        match=r"^messages\[0\]\.content\[2\]\.image: the image is "
        r"13000x13000 = 169000000 pixels, more than "
        r"max_image_pixels=16777216",
    ):
        processor.process(_chat(_png(32, 32), bomb))
    assert decodes == []  # not even the small image before it was decoded


def test_images_adding_up_past_the_request_limit_are_refused_before_any_decodes(vl_path, decodes):
    processor = InputProcessor.from_pretrained(
        vl_path, max_image_pixels=64 * 64, max_image_pixels_per_request=3 * 64 * 64
    )
    ok = _chat(*[_png(64, 64)] * 3)
    ids, features = processor.process(ok)
    assert len(features) == 3 and decodes == [(64, 64)] * 3
    decodes.clear()
    with pytest.raises(
        ValueError,
        match=r"^messages\[0\]\.content\[4\]\.image: the request's "
        r"images add up to more than "
        r"max_image_pixels_per_request=12288",
    ):
        processor.process(_chat(*[_png(64, 64)] * 4))
    with pytest.raises(
        ValueError,
        match=r"^messages\[0\]\.content\[1\]\.image: the image is "
        r"65x64",
    ):
        processor.process(_chat(_png(65, 64)))
    assert decodes == []


def test_a_1x1_image_is_served_and_not_an_image_is_named(vl_path):
    processor = InputProcessor.from_pretrained(vl_path)
    ids, features = processor.process(_chat(_png(1, 1)))
    pad = processor.mm_processor.image_token_id
    # The processor scales it up to its minimum: one merged 2x2 grid of patches.
    assert features[0].length == ids.count(pad) >= 1
    with pytest.raises(
        ValueError,
        match=r"^messages\[0\]\.content\[1\]\.image: cannot decode: "
        "not an image",
    ):
        processor.process(_chat(b"GIF89a but not really"))


class _RecordingTokenizer:
    """The real tokenizer, recording the length of every text it encodes."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.encoded: list[int] = []

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def encode(self, text, **kwargs):
        self.encoded.append(len(text))
        return self._tokenizer.encode(text, **kwargs)


@pytest.fixture
def text_processor(tiny_qwen3_path) -> InputProcessor:
    processor = InputProcessor.from_pretrained(tiny_qwen3_path, max_model_len=64)
    processor.tokenizer = _RecordingTokenizer(processor.tokenizer)
    return processor


def _words(n: int) -> str:
    return " ".join(f"w{i % 97}x{i % 13}" for i in range(n))


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(text_processor):
    limit = text_processor.max_prompt_bytes
    # The documented rule: max_model_len x the longest token in bytes.
    longest = max(
        len(text_processor.decode([i], skip_special_tokens=False).encode())
        for i in range(len(text_processor.tokenizer))
    )
    assert limit == 64 * longest
    huge = "a" * (8 << 20)
    for prompt, field in (
        (huge, "prompt"),
        ({"prompt": huge}, "prompt"),
        ({"messages": [{"role": "user", "content": huge}]}, "messages"),
    ):
        with pytest.raises(
            ValueError,
            match=f"^{field}: the prompt is [0-9]+ bytes, more than max_prompt_bytes={limit}",
        ):
            text_processor.process(prompt)
    assert text_processor.tokenizer.encoded == []
    # Just under the limit is tokenized (and then counted against max_model_len).
    text_processor.process("b" * limit)
    assert text_processor.tokenizer.encoded == [limit]


def test_truncation_tokenizes_only_a_tail_and_keeps_the_same_last_tokens(text_processor):
    text = _words(20_000)  # about 180 KB, far past the limit
    assert len(text) > 10 * text_processor.max_prompt_bytes
    want = text_processor.tokenizer._tokenizer.encode(text)[-40:]
    ids, _ = text_processor.process(text, truncate_prompt_tokens=40)
    assert ids == want
    # Only a tail holding 40 tokens (and the slack) was tokenized.
    assert text_processor.tokenizer.encoded == [(40 + 16) * text_processor.max_token_bytes]


def test_max_tokens_beyond_the_context_is_clamped_to_it(text_processor):
    params = SamplingParams(max_tokens=10**9, min_tokens=10**8)
    (req,) = build_requests(text_processor, "r", {"prompt_token_ids": [5] * 24}, params)
    assert req.sampling_params.max_tokens == 64 - 24
    assert req.sampling_params.min_tokens == 64 - 24
    (req,) = build_requests(
        text_processor, "r", {"prompt_token_ids": [5] * 24}, SamplingParams(max_tokens=7)
    )
    assert req.sampling_params.max_tokens == 7
    with pytest.raises(
        ValueError, match="prompt_token_ids: the prompt has 65 tokens, more than max_model_len=64"
    ):
        build_requests(text_processor, "r", {"prompt_token_ids": [5] * 65}, params)


def test_compiled_grammars_are_cached_within_a_byte_bound(tiny_qwen3_path):
    from transformers import AutoTokenizer

    from tokenbudget.core.structured.manager import StructuredOutputManager

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_path)
    specs = [
        StructuredOutputParams(choice=[f"option {k} {i}" for i in range(1500)]) for k in range(3)
    ]
    from tokenbudget.core.structured.grammar_cache import SIZE_OVERHEAD

    probe = StructuredOutputManager(tokenizer, 1280)
    # What the cache counts for a grammar compiled in this process (issue 26 item 13).
    size = int(probe.compile(specs[0]).memory_size_bytes * SIZE_OVERHEAD)
    assert size > 100_000
    manager = StructuredOutputManager(tokenizer, 1280, cache_bytes=int(2.5 * size))
    for spec in specs:
        manager._compiled(spec).result(60)
        manager._evict()
    # Count would keep all three (cache_size 128); bytes keep the newest two.
    assert len(manager._cache) == 2 and manager.cached_bytes <= int(2.5 * size)
    first = manager._compiled(specs[0])  # evicted: compiled again
    assert first.result(60) is not None
    manager.shutdown()
    probe.shutdown()

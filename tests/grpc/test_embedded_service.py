"""add_generation_servicer on the caller's own grpc.Server, over a fake
executor, with a tiny Qwen2.5-VL's tokenizer and image processor: image
inputs are validated and reach the scheduler as multimodal features."""

from __future__ import annotations

import io
from concurrent.futures import Future

import grpc
import numpy as np
import pytest

from tokenbudget.core import CacheConfig, ModelRunnerOutput, SamplingParams, SchedulerConfig
from tokenbudget.server.engine.core import EngineCore
from tokenbudget.server.engine.async_engine import AsyncEngine

FAKE_TOKEN = 42


class FakeExecutor:
    """Samples FAKE_TOKEN once a request's prompt is computed; records new requests."""

    def __init__(self) -> None:
        self.new_requests = []
        self._prompt_len: dict[str, int] = {}

    def initialize(self, cache_config, scheduler_config) -> int:
        return 64

    def execute_model(self, so) -> Future:
        for r in so.scheduled_new_reqs:
            self.new_requests.append(r)
            self._prompt_len[r.req_id] = len(r.prompt_token_ids)
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        computed.update(
            zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens)
        )
        req_ids = list(so.num_scheduled_tokens)
        sampled = [
            [FAKE_TOKEN] if computed[r] + n >= self._prompt_len[r] else []
            for r, n in so.num_scheduled_tokens.items()
        ]
        fut: Future = Future()
        fut.set_result(ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled))
        return fut

    def shutdown(self) -> None:
        pass


def _png(seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, serving):
    from tokenbudget.server.engine.input_processor import InputProcessor
    from tokenbudget.server.testing.tiny_vl_models import build_tiny_qwen2_5_vl

    path = build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vl"))
    executor = FakeExecutor()
    core = EngineCore(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=512),
        CacheConfig(block_size=16),
        executor,
    )
    engine = AsyncEngine(
        core, InputProcessor.from_pretrained(path), model_name="tiny-vl", is_vision_language=True
    )
    with serving(engine) as client:
        yield client, executor, engine


PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _chat(*parts) -> dict:
    return {"messages": [{"role": "user", "content": list(parts)}]}


def test_chat_with_an_image_reaches_the_scheduler_as_one_feature_over_its_placeholders(embedded):
    client, executor, engine = embedded
    image = _png(0)
    out = client.generate(
        _chat({"type": "text", "text": "Describe"}, {"type": "image", "image": image}), PARAMS
    )
    assert out.token_ids == [FAKE_TOKEN] * 3 and out.finish_reason == "length"
    new = executor.new_requests[-1]
    assert new.req_id == out.request_id
    (feature,) = new.mm_features
    pad = engine.input_processor.mm_processor.image_token_id
    run = new.prompt_token_ids[feature.offset : feature.offset + feature.length]
    assert run == [pad] * feature.length
    assert new.prompt_token_ids.count(pad) == feature.length
    assert out.prompt_tokens == len(new.prompt_token_ids)


BAD_IMAGES = {
    "undecodable image bytes": (
        lambda: _chat({"type": "text", "text": "hi"}, {"type": "image", "image": b"not a png"}),
        "messages[0].content[1].image",
    ),
    "more images than placeholders": (
        lambda: {"text": "one <|image_pad|> only", "images": [_png(1), _png(2)]},
        "placeholder",
    ),
    "images on a chat request": (
        lambda: {**_chat({"type": "text", "text": "hi"}), "images": [_png(1)]},
        "images",
    ),
}


@pytest.mark.parametrize("name", list(BAD_IMAGES))
def test_bad_image_input_is_invalid_argument_naming_the_field(embedded, name):
    client, _, engine = embedded
    make, field = BAD_IMAGES[name]
    with pytest.raises(grpc.RpcError) as err:
        client.generate(make(), PARAMS)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    assert client.generate("still serving", PARAMS).token_ids == [FAKE_TOKEN] * 3
    assert engine.num_requests == 0

"""Chat with an image through a real `server` process serving a tiny
Qwen2.5-VL, against the in-process LLM (skipped until the runner runs VL models)."""

from __future__ import annotations

import io

import numpy as np

from tokenbudget.core import SamplingParams
from tokenbudget.server.entrypoints.client import Client


def _png(seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_streamed_chat_with_an_image_equals_in_process_llm(vl_server, tiny_vl_model):
    from tokenbudget.server.entrypoints.llm import LLM

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    chat = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe the image."},
                    {"type": "image", "image": _png(0)},
                ],
            }
        ]
    }
    llm = LLM(tiny_vl_model, max_num_batched_tokens=64)
    try:
        want = llm.generate(chat, params)[0]
    finally:
        llm.shutdown()
    with Client(vl_server.address) as c:
        msgs = list(c.generate_stream(chat, params))
    assert [t for m in msgs for t in m.token_ids] == want.token_ids
    assert "".join(m.text for m in msgs) == want.text
    assert msgs[-1].usage.prompt_tokens == len(want.prompt_token_ids)

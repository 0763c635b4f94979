"""MultiModalProcessor: placeholder expansion, features, hashing, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tokenbudget.worker.vision import mm_token_type_ids


def test_checkpoint_token_ids_are_the_tokenizers(vl):
    tok, cfg = vl.processor.tokenizer, vl.model.config
    for attr, token in [
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ]:
        assert getattr(cfg, attr) == tok.convert_tokens_to_ids(token)
    assert vl.model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg.text_config.vocab_size >= len(tok)


def test_pad_run_length_is_grid_size_over_merge_squared(vl, two_image_chat):
    ids, features = vl.processor.process_messages(two_image_chat)
    pad = vl.model.config.image_token_id
    merge = vl.model.config.vision_config.spatial_merge_size
    assert [i for i, t in enumerate(ids) if t == pad] == [
        p for f in features for p in range(f.offset, f.offset + f.length)
    ]
    for f in features:
        assert f.data["image_grid_thw"].shape == (1, 3)
        assert f.length == int(f.data["image_grid_thw"].prod()) // merge**2
        # The placeholder run sits between vision start/end (outside the range).
        assert ids[f.offset - 1] == vl.model.config.vision_start_token_id
        assert ids[f.offset + f.length] == vl.model.config.vision_end_token_id
    assert len({f.length for f in features}) == 2  # the two images differ in size


def test_placeholders_match_the_models_image_features(vl, two_image_chat):
    ids, features = vl.processor.process_messages(two_image_chat)
    pixel_values = torch.cat([f.data["pixel_values"] for f in features])
    grid = torch.cat([f.data["image_grid_thw"] for f in features])
    with torch.inference_mode():
        per_image = vl.model.get_image_features(pixel_values, grid).pooler_output
        # The stock forward checks that pad count equals the feature count.
        vl.model(
            input_ids=torch.tensor([ids]),
            pixel_values=pixel_values,
            image_grid_thw=grid,
            mm_token_type_ids=mm_token_type_ids(len(ids), features),
        )
    assert [e.shape[0] for e in per_image] == [f.length for f in features]


def test_text_around_images_is_the_chat_template_rendering(vl, images, make_chat):
    messages = make_chat("Describe", images[0], "now.")
    ids, (feature,) = vl.processor.process_messages(messages)
    tok = vl.processor.tokenizer
    single = tok.encode(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    pad_at = single.index(vl.model.config.image_token_id)
    assert ids[: feature.offset] == single[:pad_at]
    assert ids[feature.offset + feature.length :] == single[pad_at + 1 :]


def test_text_only_messages_have_no_features(vl):
    ids, features = vl.processor.process_messages([{"role": "user", "content": "hi there"}])
    assert features == [] and vl.model.config.image_token_id not in ids


def test_mm_hash_is_sha_of_content(vl, images, make_png, make_chat):
    proc = vl.processor
    _, (a,) = proc.process_messages(make_chat("x", images[0]))
    _, (b,) = proc.process_messages(make_chat("other text", bytes(images[0])))
    _, (c,) = proc.process_messages(make_chat("x", make_png(60, 90, seed=99)))
    assert a.mm_hash == b.mm_hash != c.mm_hash
    assert len(a.mm_hash) == 64 and int(a.mm_hash, 16) >= 0


def test_pil_images_hash_by_pixels(vl, make_chat):
    pixels = np.random.RandomState(5).randint(0, 256, (50, 80, 3), dtype=np.uint8)
    same = [Image.fromarray(pixels), Image.fromarray(pixels.copy())]
    other = pixels.copy()
    other[0, 0, 0] ^= 1
    hashes = [
        vl.processor.process_messages(make_chat(im))[1][0].mm_hash
        for im in [*same, Image.fromarray(other)]
    ]
    assert hashes[0] == hashes[1] != hashes[2]


def test_undecodable_image_bytes_name_the_field(vl, images, make_chat):
    messages = make_chat("look", images[0], b"definitely not an image")
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[2\]\.image: cannot decode"):
        vl.processor.process_messages(messages)


def test_truncated_image_bytes_are_rejected(vl, images, make_chat):
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.image"):
        vl.processor.process_messages(make_chat(images[0][:200]))


def test_unprocessable_image_names_the_field(vl, make_png, make_chat):
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]\.image: .*aspect ratio"):
        vl.processor.process_messages(make_chat("thin", make_png(2, 500, seed=3)))


def test_non_image_value_names_the_field(vl, make_chat):
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]\.image: expected"):
        vl.processor.process_messages(make_chat("a", 42))


def test_more_placeholders_than_images_is_an_error(vl, images, make_chat):
    messages = make_chat("sneaky <|image_pad|> text", images[0])
    with pytest.raises(ValueError, match=r"messages: 1 image\(s\) but the prompt has 2"):
        vl.processor.process_messages(messages)


def test_image_count_mismatch_in_a_raw_prompt(vl, images):
    prompt = "<|vision_start|><|image_pad|><|vision_end|> what is this?"
    with pytest.raises(ValueError, match=r"prompt: 2 image\(s\) but the prompt has 1"):
        vl.processor.process_prompt(prompt, images)
    with pytest.raises(ValueError, match=r"prompt: 0 image\(s\) but the prompt has 1"):
        vl.processor.process_prompt(prompt, [])
    ids, (f,) = vl.processor.process_prompt(prompt, images[:1])
    assert ids[f.offset : f.offset + f.length] == [vl.processor.image_token_id] * f.length


def test_unknown_part_type_names_the_field(vl):
    messages = [{"role": "user", "content": [{"type": "audio", "audio": b""}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.type"):
        vl.processor.process_messages(messages)


def test_limit_mm_per_prompt_refuses_more_images_than_it_allows(vl, two_image_chat, images):
    """vLLM's limit_mm_per_prompt ({"image": N}, server --limit-mm-per-prompt)."""
    from tokenbudget.server.engine.mm_processor import MultiModalProcessor

    one = MultiModalProcessor(
        vl.processor.tokenizer, vl.processor.image_processor, max_images_per_prompt=1
    )
    with pytest.raises(
        ValueError,
        match="messages: 2 images, more than the server's limit_mm_per_prompt of 1 per prompt",
    ):
        one.process_messages(two_image_chat)
    pad = vl.model.config.image_token_id
    ids, features = one.process_prompt([1, pad, 2], images[:1])
    assert len(features) == 1
    two = MultiModalProcessor(
        vl.processor.tokenizer, vl.processor.image_processor, max_images_per_prompt=2
    )
    assert len(two.process_messages(two_image_chat)[1]) == 2

"""VisionEncoder against the model's own image feature path."""

from __future__ import annotations

import pytest
import torch

from tokenbudget.worker.vision import VisionEncoder, is_vision_model


def _stock_features(model, features):
    pixel_values = torch.cat([f.data["pixel_values"] for f in features])
    grid = torch.cat([f.data["image_grid_thw"] for f in features])
    with torch.inference_mode():
        return model.get_image_features(pixel_values, grid, return_dict=True)


@pytest.fixture
def features(vl, two_image_chat):
    return vl.processor.process_messages(two_image_chat)[1]


@pytest.mark.parametrize("which", [[0], [1], [0, 1]])
def test_encoder_output_equals_get_image_features(vl, features, which):
    chosen = [features[i] for i in which]
    encoder = VisionEncoder(vl.model)
    outputs = encoder.encode(chosen)
    stock = _stock_features(vl.model, chosen)
    assert list(outputs) == [f.mm_hash for f in chosen]
    for i, f in enumerate(chosen):
        out = outputs[f.mm_hash]
        assert out.embeds.shape == (f.length, vl.model.config.text_config.hidden_size)
        assert torch.equal(out.embeds, stock.pooler_output[i])
        if vl.name == "qwen3_vl":
            assert len(out.deepstack) == len(vl.model.config.vision_config.deepstack_visual_indexes)
            for layer, d in enumerate(out.deepstack):
                assert torch.equal(d, stock.deepstack_features[layer][i])
        else:
            assert out.deepstack is None


def test_num_calls_counts_tower_invocations(vl, features):
    encoder = VisionEncoder(vl.model)
    encoder.encode(features)
    assert encoder.num_calls == 1
    encoder.encode(features[:1])
    assert encoder.num_calls == 2
    assert encoder.encode([]) == {} and encoder.num_calls == 2


def test_repeated_image_is_encoded_once(vl, images, make_chat):
    _, features = vl.processor.process_messages(make_chat(images[0], "and again", images[0]))
    assert features[0].mm_hash == features[1].mm_hash
    outputs = VisionEncoder(vl.model).encode(features)
    stock = _stock_features(vl.model, features[:1])
    assert list(outputs) == [features[0].mm_hash]
    assert torch.equal(outputs[features[0].mm_hash].embeds, stock.pooler_output[0])


def test_text_only_model_is_not_a_vision_model(vl, tmp_path):
    from transformers import AutoModelForCausalLM

    from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

    assert is_vision_model(vl.model)
    text_model = AutoModelForCausalLM.from_pretrained(build_tiny_qwen3(tmp_path / "t"))
    assert not is_vision_model(text_model)
    with pytest.raises(ValueError, match="not a vision-language model"):
        VisionEncoder(text_model)

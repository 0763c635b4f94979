"""The runner's recipe (documented in tokenbudget.worker.vision) against the
stock transformers forward and generate()."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tokenbudget.server.testing.tiny_vl_models import hf_generate_vl, hf_generate_vl_ids
from tokenbudget.worker.vision import (
    VisionEncoder,
    get_mrope_positions,
    merge_multimodal_embeddings,
    mm_token_type_ids,
    mrope_positions_slice,
)


@pytest.fixture
def prompt(vl, two_image_chat):
    return vl.processor.process_messages(two_image_chat)


def _stock_logits(model, ids, features):
    with torch.inference_mode():
        return model(
            input_ids=torch.tensor([ids]),
            pixel_values=torch.cat([f.data["pixel_values"] for f in features]),
            image_grid_thw=torch.cat([f.data["image_grid_thw"] for f in features]),
            mm_token_type_ids=mm_token_type_ids(len(ids), features),
        ).logits[0]


def _embed_chunk(model, ids, start, end, features, encoder_outputs):
    embeds = model.get_input_embeddings()(torch.tensor(ids[start:end]))
    lm_kwargs = merge_multimodal_embeddings(embeds, [(0, start, end, features)], encoder_outputs)
    return embeds, lm_kwargs


def _run_lm(model, embeds, positions, lm_kwargs, cache=None):
    hidden = model.model.language_model(
        inputs_embeds=embeds[None],
        position_ids=positions[:, None, :],
        past_key_values=cache,
        use_cache=cache is not None,
        **lm_kwargs,
    ).last_hidden_state
    return model.lm_head(hidden[0])


def _cuts_through_both_images(features):
    a, b = features
    return [0, a.offset + a.length // 2, b.offset + 1, None]


@torch.inference_mode()
def test_recipe_full_sequence_logits_equal_stock_forward(vl, prompt):
    ids, features = prompt
    encoder_outputs = VisionEncoder(vl.model).encode(features)
    embeds, lm_kwargs = _embed_chunk(vl.model, ids, 0, len(ids), features, encoder_outputs)
    assert ("deepstack_visual_embeds" in lm_kwargs) == (vl.name == "qwen3_vl")
    positions, _ = get_mrope_positions(vl.model, ids, features)
    assert positions.shape == (3, len(ids))
    logits = _run_lm(vl.model, embeds, positions, lm_kwargs)
    assert torch.equal(logits, _stock_logits(vl.model, ids, features))


@torch.inference_mode()
def test_chunked_merge_builds_the_same_inputs(vl, prompt):
    ids, features = prompt
    encoder_outputs = VisionEncoder(vl.model).encode(features)
    full, full_kwargs = _embed_chunk(vl.model, ids, 0, len(ids), features, encoder_outputs)
    cuts = _cuts_through_both_images(features)[:-1] + [len(ids)]
    chunks = [
        _embed_chunk(vl.model, ids, s, e, features, encoder_outputs) for s, e in zip(cuts, cuts[1:])
    ]
    assert torch.equal(torch.cat([c[0] for c in chunks]), full)
    if vl.name == "qwen3_vl":
        masks = [c[1]["visual_pos_masks"] for c in chunks]
        assert torch.equal(torch.cat(masks, dim=1), full_kwargs["visual_pos_masks"])
        for layer, ref in enumerate(full_kwargs["deepstack_visual_embeds"]):
            got = torch.cat([c[1]["deepstack_visual_embeds"][layer] for c in chunks])
            assert torch.equal(got, ref)


@torch.inference_mode()
def test_packed_batch_of_two_requests_merges_each_segment(vl, prompt):
    """Rows of a request in a packed batch get the same values as alone."""
    ids, features = prompt
    encoder_outputs = VisionEncoder(vl.model).encode(features)
    mid = features[0].offset + 2
    first, first_kwargs = _embed_chunk(vl.model, ids, mid, len(ids), features, encoder_outputs)
    second, second_kwargs = _embed_chunk(vl.model, ids, 0, mid, features, encoder_outputs)
    packed = vl.model.get_input_embeddings()(torch.tensor(ids[mid:] + ids[:mid]))
    lm_kwargs = merge_multimodal_embeddings(
        packed, [(0, mid, len(ids), features), (len(ids) - mid, 0, mid, features)], encoder_outputs
    )
    assert torch.equal(packed, torch.cat([first, second]))
    if vl.name == "qwen3_vl":
        assert torch.equal(
            lm_kwargs["visual_pos_masks"],
            torch.cat([first_kwargs["visual_pos_masks"], second_kwargs["visual_pos_masks"]], dim=1),
        )
        for got, a, b in zip(
            lm_kwargs["deepstack_visual_embeds"],
            first_kwargs["deepstack_visual_embeds"],
            second_kwargs["deepstack_visual_embeds"],
        ):
            assert torch.equal(got, torch.cat([a, b]))


def test_missing_encoder_output_is_reported(vl, prompt):
    ids, features = prompt
    embeds = torch.zeros(len(ids), vl.model.config.text_config.hidden_size)
    with pytest.raises(KeyError, match=features[0].mm_hash):
        merge_multimodal_embeddings(embeds, [(0, 0, len(ids), features)], {})


@torch.inference_mode()
def test_mrope_delta_matches_the_models_rope_deltas(vl, prompt):
    ids, features = prompt
    positions, delta = get_mrope_positions(vl.model, ids, features)
    _stock_logits(vl.model, ids, features)  # caches model.model.rope_deltas
    assert delta == int(vl.model.model.rope_deltas.reshape(-1)[0])
    assert delta < 0  # images take fewer positions than tokens
    assert int(positions.max()) + 1 == len(ids) + delta
    decode = mrope_positions_slice(positions, delta, len(ids) - 2, len(ids) + 3)
    assert torch.equal(decode[:, :2], positions[:, -2:])
    assert torch.equal(decode[:, 2:], (torch.arange(len(ids), len(ids) + 3) + delta).expand(3, -1))


def test_text_only_prompt_positions_are_plain(vl):
    positions, delta = get_mrope_positions(vl.model, [5, 6, 7, 8], [])
    assert delta == 0 and torch.equal(positions, torch.arange(4).expand(3, -1))


@torch.inference_mode()
def test_chunked_prefill_and_decode_match_generate(vl, prompt):
    """The whole recipe with a KV cache: prefill in chunks that cut through both
    images (encoder run per chunk, as the scheduler would), then greedy decode."""
    ids, features = prompt
    max_new_tokens = 6
    cuts = _cuts_through_both_images(features)[:-1] + [len(ids)]
    encoder = VisionEncoder(vl.model)
    positions, delta = get_mrope_positions(vl.model, ids, features)
    cache = DynamicCache(config=vl.model.config.text_config)
    encoder_outputs = {}
    chunk_logits = []
    for start, end in zip(cuts, cuts[1:]):
        starting = [f for f in features if start <= f.offset < end]
        encoder_outputs.update(encoder.encode(starting))
        embeds, lm_kwargs = _embed_chunk(vl.model, ids, start, end, features, encoder_outputs)
        chunk_logits.append(
            _run_lm(
                vl.model,
                embeds,
                mrope_positions_slice(positions, delta, start, end),
                lm_kwargs,
                cache,
            )
        )
    assert encoder.num_calls == 2
    torch.testing.assert_close(
        torch.cat(chunk_logits), _stock_logits(vl.model, ids, features), rtol=1e-4, atol=1e-5
    )

    tokens = [int(chunk_logits[-1][-1].argmax())]
    decode_logits = [chunk_logits[-1][-1:]]
    for i in range(len(ids), len(ids) + max_new_tokens - 1):
        embeds = vl.model.get_input_embeddings()(torch.tensor(tokens[-1:]))
        decode_logits.append(
            _run_lm(vl.model, embeds, mrope_positions_slice(positions, delta, i, i + 1), {}, cache)
        )
        tokens.append(int(decode_logits[-1][-1].argmax()))
    assert tokens == hf_generate_vl_ids(vl.model, ids, features, max_new_tokens, ignore_eos=True)
    # Decode positions (index + delta) against the stock forward over prompt + outputs.
    stock = _stock_logits(vl.model, ids + tokens[:-1], features)[len(ids) - 1 :]
    torch.testing.assert_close(torch.cat(decode_logits), stock, rtol=1e-4, atol=1e-5)


def test_engine_loaded_from_the_folder_gives_hf_generate_vl_tokens(vl, two_image_chat):
    from tokenbudget.core import SamplingParams
    from tokenbudget.server import LLM

    want = hf_generate_vl(vl.path, two_image_chat, 4, ignore_eos=True)
    ids, features = vl.processor.process_messages(two_image_chat)
    assert want == hf_generate_vl_ids(vl.model, ids, features, 4, ignore_eos=True)
    # The engine, loading the same folder, runs the images through its own
    # vision path and paged attention: it must give the oracle's tokens.
    llm = LLM(vl.path, dtype="float32", device="cpu", num_gpu_blocks=64)
    try:
        got = llm.generate(
            [{"messages": two_image_chat}],
            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        )[0]
    finally:
        llm.shutdown()
    assert got.prompt_token_ids == ids
    assert got.token_ids == want

"""Vision pieces of the model runner for Qwen2.5-VL / Qwen3-VL (transformers 5.x).

The runner keeps the stock ``*ForConditionalGeneration`` model and drives its
parts itself, so the vision tower runs only for the encoder inputs the
scheduler listed and a chunk boundary may cut through an image.

Per request, once (at admission)::

    positions, delta = get_mrope_positions(model, prompt_token_ids, mm_features)
    # positions: LongTensor[3, prompt_len] (t, h, w rows); delta: int

Per step::

    # 1. Encoder: the features listed in scheduled_encoder_inputs[req_id].
    cache.update(encoder.encode([req.mm_features[i] for i in idx]))   # by mm_hash
    for h in scheduler_output.free_encoder_mm_hashes: cache.pop(h, None)

    # 2. Text embeddings of the packed batch, then the image rows.
    embeds = model.get_input_embeddings()(input_ids)                  # [S, hidden]
    segments = [(row, start, end, req.mm_features) for each request]  # row: its
    # first row in the packed batch; it has tokens [start, end) scheduled.
    lm_kwargs = merge_multimodal_embeddings(embeds, segments, cache)

    # 3. Positions: three rows per token.
    pos = torch.cat([mrope_positions_slice(p, d, start, end) for each request], 1)

    # 4. The language model, then the head.
    hidden = model.model.language_model(
        inputs_embeds=embeds[None], position_ids=pos[:, None, :].to(device),
        **lm_kwargs, **attention_kwargs).last_hidden_state
    logits = model.lm_head(hidden[0, rows_to_sample])

(a) Embedding merge. Token ``p`` of a request with ``offset <= p < offset +
length`` for one of its features takes row ``p - offset`` of that feature's
``EncoderOutput.embeds``; every other token keeps its text embedding. Only the
part of ``[offset, offset + length)`` inside the scheduled ``[start, end)`` is
written, so a chunk may begin or end inside an image; the encoder output must
stay cached until the last chunk touching the image has run.

(b) Qwen3-VL deepstack. ``Qwen3VLTextModel.forward(..., visual_pos_masks,
deepstack_visual_embeds)``: after decoder layer ``i`` (for ``i <
len(deepstack_visual_embeds)``) it does ``hidden[visual_pos_masks] +=
deepstack_visual_embeds[i]``. ``visual_pos_masks`` is a bool tensor shaped like
``inputs_embeds[..., 0]`` ([1, S] for a packed batch); ``deepstack_visual_embeds[i]``
has one row per True position, in row-major mask order. ``merge_multimodal_embeddings``
returns exactly these two keyword arguments (or ``{}`` when the step has no
image tokens, or for Qwen2.5-VL which has no deepstack). Call
``model.model.language_model`` directly: ``Qwen3VLModel.forward`` passes its own
``visual_pos_masks=None`` and would reject ours.

(c) Positions. The text models take ``position_ids`` of shape [3, batch, S]
(t, h, w). Pass them always: without them the model falls back to 1-D
positions or to a ``rope_deltas`` cached on ``model.model`` by an earlier call.
Prompt tokens take the columns of ``get_mrope_positions``; a token at index
``i >= prompt_len`` (decode, or a resumed request's outputs) has position
``i + delta`` on all three rows. A 4-row form [text, t, h, w] also exists;
its first row only feeds mask creation and ``position_ids`` passed to the
attention function, which a paged attention backend does not need.

Gotchas:
- The vision tower's attention also goes through
  ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``; a custom paged
  attention must be set on the text config only:
  ``from_pretrained(path, attn_implementation={"text_config": "ours",
  "vision_config": "sdpa"})`` (checked: the vision blocks then stay on sdpa).
- ``get_rope_index`` groups consecutive placeholder tokens, so two images with
  no token between them would be read as one; the chat template always puts
  ``<|vision_end|><|vision_start|>`` between images.
- The stock ``forward``/``generate`` need ``mm_token_type_ids`` (see
  ``mm_token_type_ids()``) with image inputs, else they use 1-D positions
  (Qwen2.5-VL) or raise (Qwen3-VL).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenbudget.core.request import MultiModalFeature

if TYPE_CHECKING:
    from tokenbudget.core.outputs import SchedulerOutput
    from tokenbudget.worker.input_batch import RequestState, StepInputs


def is_vision_model(model: torch.nn.Module) -> bool:
    """True for a Qwen-VL-style model: a vision tower plus image placeholders."""
    config = getattr(model, "config", None)
    return (
        getattr(config, "vision_config", None) is not None
        and getattr(config, "image_token_id", None) is not None
        and callable(getattr(model, "get_image_features", None))
    )


@dataclass(slots=True)
class EncoderOutput:
    """The vision tower's output for one image: one row per placeholder token."""

    embeds: torch.Tensor  # [length, hidden]
    # Qwen3-VL: one [length, hidden] tensor per deepstack layer; None otherwise.
    deepstack: list[torch.Tensor] | None = None


class VisionEncoder:
    """Runs a VL model's vision tower over a list of images in one call."""

    def __init__(self, model: torch.nn.Module) -> None:
        if not is_vision_model(model):
            raise ValueError(f"{type(model).__name__} is not a vision-language model")
        self.model = model
        self.num_calls = 0

    @torch.inference_mode()
    def encode(self, features: Sequence[MultiModalFeature]) -> dict[str, EncoderOutput]:
        """Encode ``features`` (each image once, by ``mm_hash``) and split the
        batched output back per image."""
        unique = list({f.mm_hash: f for f in features}.values())
        if not unique:
            return {}
        device = self.model.device
        pixel_values = torch.cat([f.data["pixel_values"] for f in unique]).to(device)
        grid_thw = torch.cat([f.data["image_grid_thw"] for f in unique]).to(device)
        out = self.model.get_image_features(pixel_values, grid_thw, return_dict=True)
        self.num_calls += 1
        deepstack = getattr(out, "deepstack_features", None)
        results = {}
        for i, feature in enumerate(unique):
            embeds = out.pooler_output[i]
            if embeds.shape[0] != feature.length:
                raise ValueError(
                    f"image {feature.mm_hash}: the encoder made {embeds.shape[0]} "
                    f"embeddings for a placeholder of {feature.length} tokens"
                )
            results[feature.mm_hash] = EncoderOutput(
                embeds=embeds, deepstack=None if deepstack is None else [d[i] for d in deepstack]
            )
        return results


def mm_token_type_ids(num_tokens: int, mm_features: Sequence[MultiModalFeature]) -> torch.Tensor:
    """[1, num_tokens] int tensor, 1 on image placeholder tokens (what the HF
    models and generate() take as ``mm_token_type_ids``)."""
    types = torch.zeros(1, num_tokens, dtype=torch.int32)
    for f in mm_features:
        types[0, f.offset : f.offset + f.length] = 1
    return types


def get_mrope_positions(
    model: torch.nn.Module,
    prompt_token_ids: Sequence[int],
    mm_features: Sequence[MultiModalFeature],
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions of a prompt: (LongTensor[3, len(prompt)] on CPU, delta).

    Token ``i`` past the prompt has position ``i + delta`` on every row.
    Computed by the model's own ``get_rope_index`` from the image grids.
    """
    num_tokens = len(prompt_token_ids)
    if not mm_features:
        return torch.arange(num_tokens).expand(3, -1).clone(), 0
    features = sorted(mm_features, key=lambda f: f.offset)
    input_ids = torch.tensor([list(prompt_token_ids)], dtype=torch.long)
    grid_thw = torch.cat([f.data["image_grid_thw"] for f in features]).to(torch.long)
    positions, deltas = model.model.get_rope_index(
        input_ids,
        mm_token_type_ids=mm_token_type_ids(num_tokens, features),
        image_grid_thw=grid_thw.cpu(),
    )
    return positions[:, 0, :].cpu(), int(deltas.reshape(-1)[0])


def mrope_positions_slice(
    prompt_positions: torch.Tensor, delta: int, start: int, end: int
) -> torch.Tensor:
    """Positions [3, end - start] of tokens [start, end) of a request whose
    prompt positions and delta come from ``get_mrope_positions``."""
    prompt_len = prompt_positions.shape[1]
    parts = []
    if start < prompt_len:
        parts.append(prompt_positions[:, start : min(end, prompt_len)])
    if end > prompt_len:
        beyond = torch.arange(max(start, prompt_len), end) + delta
        parts.append(beyond.expand(3, -1))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def merge_multimodal_embeddings(
    inputs_embeds: torch.Tensor,
    segments: Sequence[tuple[int, int, int, Sequence[MultiModalFeature]]],
    encoder_outputs: Mapping[str, EncoderOutput],
) -> dict[str, Any]:
    """Write image embeddings into a packed batch's ``inputs_embeds`` [S, hidden]
    in place and return the deepstack keyword arguments for the language model.

    ``segments``: per request, ``(row, start, end, mm_features)``: rows
    ``row .. row + end - start`` of the batch hold its tokens ``[start, end)``.
    Segments must be in ascending ``row`` order (deepstack rows follow the mask).
    """
    rows: list[torch.Tensor] = []
    deepstack: list[list[torch.Tensor]] = []
    device = inputs_embeds.device
    for row, start, end, features in segments:
        for f in sorted(features, key=lambda f: f.offset):
            lo, hi = max(start, f.offset), min(end, f.offset + f.length)
            if lo >= hi:
                continue
            out = encoder_outputs.get(f.mm_hash)
            if out is None:
                raise KeyError(
                    f"no encoder output for image {f.mm_hash} scheduled in tokens [{start}, {end})"
                )
            # Sorted, non-overlapping features keep the rows ascending.
            batch_rows = torch.arange(row + lo - start, row + hi - start, device=device)
            inputs_embeds[batch_rows] = out.embeds[lo - f.offset : hi - f.offset].to(
                device, inputs_embeds.dtype
            )
            rows.append(batch_rows)
            if out.deepstack is not None:
                deepstack.append([d[lo - f.offset : hi - f.offset] for d in out.deepstack])
    if not deepstack:
        return {}
    mask = torch.zeros(inputs_embeds.shape[0], dtype=torch.bool, device=device)
    mask[torch.cat(rows)] = True
    per_layer = [torch.cat(layer).to(device, inputs_embeds.dtype) for layer in zip(*deepstack)]
    return {"visual_pos_masks": mask[None], "deepstack_visual_embeds": per_layer}


class VisionInputs:
    """The VL part of a step: run the vision tower for the encoder inputs the
    scheduler listed, cache outputs by mm_hash, merge them into the packed
    ``inputs_embeds`` and build M-RoPE positions (3 rows per token)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.encoder = VisionEncoder(model)
        self.cache: dict[str, EncoderOutput] = {}

    def free(self, mm_hashes: list[str]) -> None:
        for h in mm_hashes:
            self.cache.pop(h, None)

    def init_positions(self, state: RequestState, prompt_token_ids: list[int]) -> None:
        positions, delta = get_mrope_positions(self.model, prompt_token_ids, state.mm_features)
        state.mrope_positions, state.mrope_delta = positions.numpy(), delta

    def forward(
        self,
        so: SchedulerOutput,
        step: StepInputs,
        requests: dict[str, RequestState],
        input_ids: torch.Tensor,
        meta,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        # Only the images this run's requests show (a re-run over some of the
        # step's requests must not fail on another request's bad image).
        shown = {f.mm_hash for rid in step.req_ids for f in requests[rid].mm_features}
        wanted = [
            f
            for rid, idx in so.scheduled_encoder_inputs.items()
            for f in (requests[rid].mm_features[i] for i in idx)
            if f.mm_hash in shown
        ]
        if wanted:
            self.cache.update(self.encoder.encode(wanted))
        states = [requests[rid] for rid in step.req_ids]
        embeds = self.model.get_input_embeddings()(input_ids)
        first_rows = np.cumsum(step.query_lens) - step.query_lens
        segments = [
            (
                int(first_rows[i]),
                int(step.starts[i]),
                int(step.starts[i] + step.query_lens[i]),
                s.mm_features,
            )
            for i, s in enumerate(states)
            if s.mm_features
        ]
        lm_kwargs = merge_multimodal_embeddings(embeds, segments, self.cache) if segments else {}
        positions = self._positions(step, states, first_rows).to(input_ids.device)
        hidden = self.model.model.language_model(
            inputs_embeds=embeds[None],
            position_ids=positions[:, None, :],
            paged_attn=meta,
            use_cache=False,
            **lm_kwargs,
        ).last_hidden_state
        return self.model.lm_head(hidden[0].index_select(0, keep))

    @staticmethod
    def _positions(step: StepInputs, states: list[RequestState], first_rows: np.ndarray):
        """Token i past the prompt sits at i + delta on all three rows; prompt
        tokens of image requests take their precomputed M-RoPE columns."""
        deltas = np.fromiter((s.mrope_delta for s in states), np.int64, len(states))
        positions = np.repeat((step.positions + np.repeat(deltas, step.query_lens))[None], 3, 0)
        for i, s in enumerate(states):
            start, prompt_end = int(step.starts[i]), s.num_prompt_tokens
            if s.mm_features and start < prompt_end:
                n = min(int(step.query_lens[i]), prompt_end - start)
                row = int(first_rows[i])
                positions[:, row : row + n] = s.mrope_positions[:, start : start + n]
        return torch.from_numpy(positions)

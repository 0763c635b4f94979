"""ModelRunner: SchedulerOutput in, sampled token ids out.

One step = update the persistent batch from the scheduler's deltas, build the
packed inputs (vectorised over the batch), run one forward over every
scheduled token, sample on the device at each request whose known tokens are
all computed after this step, and append those tokens to the worker's own
copy of the sequence. The next decode input always comes from that copy, so
step N+1 may be scheduled before the scheduler saw step N's token (async
scheduling); steps must simply execute in order.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import numpy as np
import torch

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.core.failures import RequestFailure, describe
from tokenbudget.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenbudget.worker.attention import build_metadata
from tokenbudget.worker.attention_select import flash_block_size_warning, resolve_backend
from tokenbudget.worker.compiled import CompiledDecoder, compile_decoder, eager_by_default
from tokenbudget.worker.cuda_graphs import DecodeGraphs, capture_decode_graphs
from tokenbudget.worker.fault_isolation import StepPart, merge_parts, run_isolating
from tokenbudget.worker.input_batch import InputBatch, RequestState, StepInputs
from tokenbudget.worker.kv_cache import (
    ParallelGroup,
    blocks_per_request,
    num_kv_blocks,
    profile_free_memory,
)
from tokenbudget.worker import kv_groups
from tokenbudget.worker.kv_transfer import HostKVCache, num_offload_slots
from tokenbudget.worker.loader import check_kv_cache_dtype, decoder_kv_shape, load_model
from tokenbudget.worker.lora import NO_LORA
from tokenbudget.worker.pooler import Pooler
from tokenbudget.worker.prompt_logprobs import prompt_logprob_rows
from tokenbudget.worker.sampler import Sampler, make_generator
from tokenbudget.worker.spec_decode import NgramProposer
from tokenbudget.worker.step_sampling import collect, sample
from tokenbudget.worker.vision import VisionInputs, is_vision_model

logger = logging.getLogger(__name__)


class StepOrderError(RuntimeError):
    """Steps reached the runner out of order: the engine's bug, not a request's."""


# Never blamed on one request: the step fails (worker/fault_isolation.py).
_FATAL = (MemoryError, torch.OutOfMemoryError, StepOrderError)


class ModelRunner:
    def __init__(
        self,
        model: str,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        attention_backend: str = "auto",
        trust_remote_code: bool = False,
        revision: str | None = None,
        kv_cache_dtype: str = "auto",
        parallel: ParallelGroup | None = None,
        enforce_eager: bool | None = None,
        cuda_graph_sizes: list[int] | None = None,
    ) -> None:
        """``parallel``: this rank's tensor-parallel group; the model is loaded
        whole on the host, sharded, then moved to the device. ``enforce_eager``:
        no compiled decoder (worker/compiled.py) and no CUDA graphs; None: eager
        on CPU only.
        ``cuda_graph_sizes``: the decode batch sizes captured (worker/cuda_graphs.py)."""
        self.device = torch.device(device)
        self.enforce_eager = (
            eager_by_default(self.device) if enforce_eager is None else enforce_eager
        )
        self.compiled: CompiledDecoder | None = None
        self.cuda_graph_sizes = cuda_graph_sizes
        self.cuda_graphs: DecodeGraphs | None = None
        self.parallel = parallel
        self.model = load_model(
            model,
            dtype=dtype,
            device=self.device if parallel is None else "cpu",
            trust_remote_code=trust_remote_code,
            revision=revision,
        )
        if parallel is not None:
            parallel.shard(self.model)
            self.model.to(self.device)
        self.dtype = next(self.model.parameters()).dtype
        check_kv_cache_dtype(kv_cache_dtype, self.dtype)
        self.text_config = self.model.config.get_text_config()
        self.attention_backend_choice = attention_backend
        self.kv_layout = kv_groups.kv_layout(self.text_config)  # KV cache groups
        self.attention_backend = resolve_backend(attention_backend, self.device, self.dtype)
        self.vision = VisionInputs(self.model) if is_vision_model(self.model) else None
        self.sampler = Sampler()
        self.pooler = Pooler(self.model)
        self.lora = NO_LORA  # a LoRAManager once enable_lora (worker/lora.py) ran
        self.requests: dict[str, RequestState] = {}
        # Requests that failed, until the scheduler's finished_req_ids drops
        # them: a step scheduled before it heard of the failure skips them.
        self.failed: dict[str, RequestFailure] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.host_kv: HostKVCache | None = None  # the host tier (worker/kv_transfer.py)
        self.num_offload_blocks = 0  # its slots, for Worker.initialize to report
        self.batch: InputBatch | None = None
        self.block_size = 0
        self.proposer: NgramProposer | None = None
        # Seconds spent per phase, for benchmarks (reset freely).
        self.timings: dict[str, float] = defaultdict(float)

    # -- setup ------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def _kv_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of the decoder (this rank's KV heads)."""
        num_layers, num_kv_heads, head_dim = decoder_kv_shape(self.text_config)
        if self.parallel is not None:
            num_kv_heads //= self.parallel.world_size
        return num_layers, num_kv_heads, head_dim

    def initialize_kv_cache(
        self, cache_config: CacheConfig, scheduler_config: SchedulerConfig
    ) -> int:
        """Size and allocate the KV cache; returns num_blocks (block 0 included)."""
        bs = cache_config.block_size
        if self.attention_backend_choice == "auto":  # flash-attn pages in place only in 256s
            self.attention_backend = resolve_backend("auto", self.device, self.dtype, block_size=bs)
        self.attention_backend = kv_groups.backend_for(self.attention_backend, self.kv_layout)
        warning = flash_block_size_warning(self.attention_backend, bs)
        if warning:
            logger.warning("attention: %s", warning)
        per_block = kv_groups.layout_block_bytes(self, bs)
        num_blocks = num_kv_blocks(
            cache_config,
            scheduler_config,
            per_block,
            self.device,
            lambda: self._profile_free_memory(cache_config, scheduler_config),
            kv_groups.blocks_per_seq(self, scheduler_config, bs),
        )
        if self.parallel is not None:
            num_blocks = self.parallel.min_over_ranks(num_blocks)
        if num_blocks < 2:
            raise ValueError(
                f"KV cache too small: {num_blocks} blocks of {per_block} bytes "
                "(need at least 2); raise kv_cache_memory or num_gpu_blocks"
            )
        self.block_size = bs
        spec = scheduler_config.speculative_config
        if spec is not None:
            self.proposer = NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
            )
        self.kv_caches = kv_groups.layout_kv_caches(self, num_blocks, bs)
        num_slots = num_offload_slots(cache_config, per_block)
        self.host_kv = HostKVCache(self.kv_caches, num_slots) if num_slots else None
        self.num_offload_blocks = num_slots
        self.batch = InputBatch(
            scheduler_config.max_num_seqs,
            scheduler_config.max_model_len + scheduler_config.num_speculative_tokens,
            blocks_per_request(scheduler_config, bs) * self.kv_layout.num_groups,
        )
        self.compiled = compile_decoder(self)
        self.cuda_graphs = capture_decode_graphs(self, scheduler_config.max_num_seqs)
        return int(num_blocks)

    def _profile_free_memory(
        self, cache_config: CacheConfig, scheduler_config: SchedulerConfig
    ) -> int:
        """GPU bytes left for KV after a forward of a full token budget."""
        return profile_free_memory(
            self.model,
            self.attention_backend,
            self._kv_shape,
            self.dtype,
            self.device,
            cache_config,
            scheduler_config,
        )

    # -- state ------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.batch
        failed = self.failed
        for rid in so.finished_req_ids:
            failed.pop(rid, None)
            state = self.requests.pop(rid, None)
            if state is not None and state.row is not None:
                batch.remove(state.row)
            self.pooler.remove(rid)
        for rid in so.preempted_req_ids:
            # Keep the state: a resumed request continues its seeded stream.
            state = self.requests.get(rid)
            if state is not None and state.row is not None:
                batch.remove(state.row)
                state.row = None
        if self.vision is not None:
            self.vision.free(so.free_encoder_mm_hashes)
        failed.update(self.lora.update(so))  # a request whose adapter fails to load
        for new in so.scheduled_new_reqs:
            try:
                params = new.sampling_params
                generator = (
                    None if params.seed is None else make_generator(params.seed, self.device)
                )
                state = RequestState(
                    new.req_id,
                    len(new.prompt_token_ids),
                    params,
                    generator,
                    list(new.mm_features),
                    eos_token_id=new.eos_token_id,
                )
                if self.vision is not None:
                    self.vision.init_positions(state, new.prompt_token_ids)
            except _FATAL:
                raise
            except Exception as exc:  # its own inputs are bad: it alone fails
                failed[new.req_id] = describe(exc)
                continue
            state.row = batch.add(new.prompt_token_ids, new.block_ids, new.output_token_ids)
            self.requests[new.req_id] = state
            if new.pooling_params is not None:
                self.pooler.add(new.req_id, new.pooling_params, len(new.prompt_token_ids))
        cached = so.scheduled_cached_reqs
        for rid, block_ids in zip(cached.req_ids, cached.new_block_ids):
            if rid in failed:
                continue
            state = self.requests[rid]
            resumed = cached.resumed_token_ids.get(rid)
            if resumed is not None:
                # Its KV is gone; the scheduler's tokens and table replace ours.
                if state.row is not None:
                    batch.remove(state.row)
                state.row = batch.add(resumed, block_ids)
            else:
                batch.append_blocks(state.row, block_ids)

    # -- step -------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.kv_swap_out or so.kv_swap_in:
            self.host_kv.copy(so.kv_swap_out, so.kv_swap_in)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty()
        req_ids = list(so.num_scheduled_tokens)
        failed = self.failed
        runnable = [r for r in req_ids if r not in failed] if failed else req_ids
        parts, new_failures = run_isolating(lambda ids: self._compute(so, ids), runnable, _FATAL)
        failed.update(new_failures)
        out = self._commit(req_ids, parts, {r: failed[r] for r in req_ids if r in failed})
        if self.proposer is not None:
            t0 = time.perf_counter()
            out.spec_token_ids = self._propose(req_ids, out.sampled_token_ids)
            self.timings["propose"] += time.perf_counter() - t0
        return out

    def _compute(self, so: SchedulerOutput, req_ids: list[str]) -> StepPart:
        """Forward and sample ``req_ids`` (some or all of the step's requests)
        without committing their tokens: on an error it can run again."""
        t0 = time.perf_counter()
        seeded = [s for s in (self.requests[r] for r in req_ids) if s.generator is not None]
        rng_states = [s.generator.get_state() for s in seeded]
        pooling = self.pooler.snapshot(req_ids)
        try:
            return self._compute_timed(so, req_ids, t0)
        except Exception:
            # A retry must draw what this attempt would have drawn, and sum
            # each pooled chunk once.
            for state, rng in zip(seeded, rng_states):
                state.generator.set_state(rng)
            self.pooler.restore(pooling)
            raise

    def _compute_timed(self, so: SchedulerOutput, req_ids: list[str], t0: float) -> StepPart:
        step = self._prepare(so, req_ids)
        pooling = self.pooler.mask(step.req_ids)
        if pooling is not None:
            step.samples &= ~pooling  # pooling requests sample nothing
        meta = self._attention_metadata(step, graphable=pooling is None)
        logits_idx = self._logits_indices(step)
        prompt_rows = prompt_logprob_rows(step, self.requests, self.batch.token_ids)
        keep = (
            logits_idx if prompt_rows is None else np.concatenate([logits_idx, prompt_rows.packed])
        )
        t1 = time.perf_counter()
        self.pooler.start_step(pooling)
        self.lora.prepare(step.req_ids, step.query_lens)
        logits = self._forward(so, step, meta, keep)
        pooled = self.pooler.pool(step.req_ids, step.starts, step.query_lens, pooling)
        t2 = time.perf_counter()
        prompt_logprobs = None
        if prompt_rows is not None:
            prompt_logprobs = prompt_rows.logprobs(logits[len(logits_idx) :])
            logits = logits[: len(logits_idx)]
        sampled_rows, ids, lps, rewind = sample(
            self.sampler, self.requests, self.batch, self.device, so, step, logits
        )
        t3 = time.perf_counter()
        vocab = logits.shape[-1]
        out = collect(self.requests, self.device, so, step, sampled_rows, ids, lps, rewind, vocab)
        out.prompt_logprobs = prompt_logprobs
        out.pooler_output = pooled
        t4 = time.perf_counter()
        self.timings["prep"] += t1 - t0
        self.timings["forward"] += t2 - t1
        self.timings["sample"] += t3 - t2
        self.timings["output"] += t4 - t3
        return out

    def _prepare(self, so: SchedulerOutput, req_ids: list[str]) -> StepInputs:
        batch = self.batch
        rows = np.fromiter((self.requests[r].row for r in req_ids), np.int64, len(req_ids))
        num_scheduled = so.num_scheduled_tokens
        query_lens = np.fromiter((num_scheduled[r] for r in req_ids), np.int64, len(req_ids))
        # New requests carry num_computed_tokens in NewRequestData, cached ones in the deltas.
        computed = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        c = so.scheduled_cached_reqs
        computed.update(zip(c.req_ids, c.num_computed_tokens))
        starts = np.fromiter((computed[r] for r in req_ids), np.int64, len(req_ids))
        num_drafts = np.zeros(len(req_ids), np.int64)
        for i, rid in enumerate(req_ids):
            drafts = so.scheduled_spec_decode_tokens.get(rid)
            if drafts:
                # Drafts sit after the known tokens as inputs only; verified
                # tokens overwrite them when appended.
                row, n = rows[i], batch.num_tokens[rows[i]]
                batch.token_ids[row, n : n + len(drafts)] = drafts
                num_drafts[i] = len(drafts)
        ends = starts + query_lens
        known = batch.num_tokens[rows] + num_drafts
        if (ends > known).any():
            bad = req_ids[int(np.argmax(ends > known))]
            raise StepOrderError(
                f"request {bad}: scheduled past the tokens the worker "
                "knows; steps must execute in the order they were scheduled"
            )
        offsets = np.repeat(starts - (np.cumsum(query_lens) - query_lens), query_lens)
        positions = np.arange(int(query_lens.sum())) + offsets
        input_ids = batch.token_ids[np.repeat(rows, query_lens), positions]
        return StepInputs(
            req_ids,
            rows,
            query_lens,
            starts,
            num_drafts,
            positions,
            input_ids,
            samples=ends >= known,
        )

    def _attention_metadata(self, step: StepInputs, graphable: bool = False):
        batch, bs = self.batch, self.block_size
        seq_lens = step.starts + step.query_lens
        rows_rep = np.repeat(step.rows, step.query_lens)
        if not self.kv_layout.plain:  # a table per group, no graphs
            return kv_groups.group_metadata(self, step, seq_lens, rows_rep)
        slot_mapping = (
            batch.block_table[rows_rep, step.positions // bs].astype(np.int64) * bs
            + step.positions % bs
        )
        if graphable and self.cuda_graphs is not None:  # decode-only: a graph's buffers
            meta = self.cuda_graphs.prepare(
                step, seq_lens, batch.block_table[step.rows], slot_mapping
            )
            if meta is not None:
                return meta
        max_blocks = -(-int(seq_lens.max()) // bs)
        return build_metadata(
            self.attention_backend,
            self.kv_caches,
            bs,
            step.query_lens,
            seq_lens,
            batch.block_table[step.rows, :max_blocks],
            slot_mapping,
            self.device,
        )

    @staticmethod
    def _logits_indices(step: StepInputs) -> np.ndarray:
        """Packed-sequence indices whose logits are needed: the last 1 + drafts
        tokens of each sampling request, in scheduled order."""
        ends = np.cumsum(step.query_lens)[step.samples]
        counts = step.num_drafts[step.samples] + 1
        return np.repeat(ends - counts, counts) + (
            np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        )

    def _forward(self, so: SchedulerOutput, step: StepInputs, meta, logits_idx: np.ndarray):
        if self.cuda_graphs is not None and self.cuda_graphs.owns(meta):
            return self.cuda_graphs.replay(meta, logits_idx)
        dev = self.device
        input_ids = torch.from_numpy(step.input_ids).to(dev, non_blocking=True)
        keep = torch.from_numpy(logits_idx).to(dev, non_blocking=True)
        if self.vision is not None:
            return self.vision.forward(so, step, self.requests, input_ids, meta, keep)
        positions = torch.from_numpy(step.positions).to(dev, non_blocking=True)
        if self.compiled is not None and not self.pooler.states:  # pooling: eager
            return self.compiled(input_ids, positions, keep, meta)
        out = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            paged_attn=meta,
            use_cache=False,
            logits_to_keep=keep,
        )
        return out.logits[0]

    def _commit(
        self, req_ids: list[str], parts: list[StepPart], failed: dict[str, RequestFailure]
    ) -> ModelRunnerOutput:
        """Append the sampled tokens to the batch and answer in scheduled order."""
        batch, requests = self.batch, self.requests
        for part in parts:
            for rid, tokens in zip(part.req_ids, part.sampled):
                if tokens:
                    batch.append_tokens(requests[rid].row, tokens)
        return merge_parts(req_ids, parts, failed)

    def _propose(self, req_ids: list[str], sampled: list[list[int]]) -> list[list[int]]:
        """Drafts for the next step of each request that sampled this step
        (after its tokens were appended; a failed request sampled nothing)."""
        samplers = np.flatnonzero(np.fromiter(map(bool, sampled), bool, len(sampled)))
        drafts: list[list[int]] = [[] for _ in req_ids]
        rows = np.fromiter(
            (self.requests[req_ids[i]].row for i in samplers), np.int64, len(samplers)
        )
        batch = self.batch
        proposals = self.proposer.propose(
            batch.token_ids, rows, np.minimum(batch.num_tokens[rows], batch.max_model_len)
        )
        for i, d in zip(samplers.tolist(), proposals):
            drafts[i] = d
        return drafts

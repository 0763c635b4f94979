"""LLM: offline batch generation in one process, like ``vllm.LLM``."""
from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenbudget.core.config import POLICY_OPTIONS, CacheConfig, SchedulerConfig
from tokenbudget.core.engine import EngineCore
from tokenbudget.core.request import Request
from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.core.structured_output import StructuredOutputManager
from tokenbudget.server.input_processor import InputProcessor, Prompt
from tokenbudget.server.output_processor import SampleState
from tokenbudget.server.request_builder import build_requests

_DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a prompt (``index`` in 0..n-1)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    # The stop token id or stop string that ended it (None for EOS or length).
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Per generated token {token_id: logprob} (sampled + top-n), when asked for.
    logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class GenerationResult:
    """The result of one prompt: its ``n`` samples in ``outputs``. The
    properties read the first sample, the only one when n = 1."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    # Per prompt token {token_id: logprob} (the prompt token + top-n; None for
    # the first token, which nothing predicts), when asked for.
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def num_cached_tokens(self) -> int:
        return self.outputs[0].num_cached_tokens

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs


def parse_memory_size(value: int | str | None) -> int | None:
    """``1073741824``, ``"1GiB"``, ``"512MB"``, ``"2g"`` -> bytes."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", str(value).lower())
    if not m:
        raise ValueError(f"kv_cache_memory must be a byte count or a size like '2GiB', got {value!r}")
    number, unit, suffix = m.groups()
    base = 1000 if suffix == "b" else 1024
    return int(float(number) * base ** " kmgt".index(unit or " "))


class LLM:
    """``LLM(model, **engine_args)``; engine args mirror the CLI flags in snake case."""

    def __init__(self, model: str, *, dtype: str = "auto", device: str | None = None,
                 max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                 max_model_len: int | None = None, block_size: int = 16,
                 num_gpu_blocks: int | None = None, kv_cache_memory: int | str | None = None,
                 gpu_memory_utilization: float = 0.9, policy: str = "fcfs",
                 enable_prefix_caching: bool = True, long_prefill_token_threshold: int = 0,
                 attention_backend: str = "auto", async_scheduling: bool = False,
                 seed: int = 0, trust_remote_code: bool = False,
                 grammar_compile_timeout_s: float = 30.0, **policy_options) -> None:
        """``policy_options``: the SGLang-style scheduling options of
        ``SchedulerConfig`` (``core.config.POLICY_OPTIONS``), e.g.
        ``max_queued_requests=100`` or ``preemption_mode="retract"``."""
        import torch

        unknown = sorted(set(policy_options) - set(POLICY_OPTIONS))
        if unknown:
            raise TypeError(f"LLM() got unknown engine argument(s) {unknown}")

        from tokenbudget.worker.executor import InProcessExecutor
        from tokenbudget.worker.worker import Worker

        torch.manual_seed(seed)  # unseeded random sampling draws from the global stream
        worker = Worker(model, dtype=dtype, device=device, attention_backend=attention_backend,
                        trust_remote_code=trust_remote_code)
        text_config = worker.model_runner.text_config
        limit = getattr(text_config, "max_position_embeddings", None) or _DEFAULT_MAX_MODEL_LEN
        if max_model_len is None:
            max_model_len = min(limit, _DEFAULT_MAX_MODEL_LEN)
        elif max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={limit}")
        self.scheduler_config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, long_prefill_token_threshold=long_prefill_token_threshold,
            policy=policy, async_scheduling=async_scheduling, **policy_options)
        self.cache_config = CacheConfig(
            block_size=block_size, num_blocks=num_gpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory_bytes=parse_memory_size(kv_cache_memory),
            gpu_memory_utilization=gpu_memory_utilization)
        self.input_processor = InputProcessor.from_pretrained(
            model, vocab_size=worker.model_runner.vocab_size, trust_remote_code=trust_remote_code)
        self.eos_token_ids = _eos_token_ids(worker.model_runner.model, self.input_processor)
        self.executor = InProcessExecutor(worker, async_mode=async_scheduling)
        # Cheap until a structured request arrives (xgrammar loads then).
        self.structured_output = StructuredOutputManager(
            self.input_processor.tokenizer, worker.model_runner.vocab_size,
            compile_timeout_s=grammar_compile_timeout_s)
        self.engine = EngineCore(self.scheduler_config, self.cache_config, self.executor,
                                 self.structured_output)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.input_processor.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[GenerationResult]:
        """One result per prompt, in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(sampling_params)} for "
                             f"{len(prompts)} prompts")
        results: list[GenerationResult] = []
        # Engine request id -> (its result, its sample's output, its SampleState).
        samples: dict[str, tuple[GenerationResult, CompletionOutput, SampleState]] = {}
        try:
            for prompt, params in zip(prompts, sampling_params):
                self._add(prompt, params, results, samples)
            self._run(samples, use_tqdm)
        except BaseException:
            self.engine.abort_requests(list(samples))
            raise
        return results

    def _make_requests(self, prompt: Prompt, params: SamplingParams
                       ) -> tuple[str, list[Request]]:
        """The id of one prompt's result and its engine requests, one per sample."""
        if params.structured is not None:
            self.structured_output.validate(params.structured)  # a bad spec fails here
        rid = f"llm-{next(self._ids)}"
        return rid, build_requests(self.input_processor, rid, prompt, params,
                                   eos_token_ids=self.eos_token_ids)

    def _add(self, prompt: Prompt, params: SamplingParams, results: list[GenerationResult],
             samples: dict) -> None:
        rid, requests = self._make_requests(prompt, params)
        result = GenerationResult(rid, requests[0].prompt_token_ids)
        results.append(result)
        for i, req in enumerate(requests):
            output = CompletionOutput(i)
            result.outputs.append(output)
            detok = self.input_processor.detokenizer(params.skip_special_tokens,
                                                     params.spaces_between_special_tokens)
            samples[req.request_id] = (result, output, SampleState(i, params, detok))
            self.engine.add_request(req)

    def _run(self, samples: dict, use_tqdm: bool) -> None:
        progress = None
        if use_tqdm:
            from tqdm import tqdm
            progress = tqdm(total=len(samples), desc="generate")
        pending = len(samples)
        while pending and self.engine.has_unfinished_requests():
            for out in self.engine.step():
                entry = samples.get(out.request_id)
                if entry is None:
                    continue
                result, output, state = entry
                if out.error is not None:  # e.g. its grammar failed to compile
                    raise out.error
                if out.prompt_logprobs:
                    result.prompt_logprobs = (result.prompt_logprobs or [None]) + \
                        out.prompt_logprobs
                if state.finished:
                    continue  # stopped by a string; its last steps were in flight
                delta = state.update([out])
                output.num_cached_tokens = max(out.num_cached_tokens, 0)
                if delta is None:
                    continue
                output.token_ids.extend(delta.token_ids)
                output.text += delta.text
                if delta.logprobs is not None:
                    output.logprobs = (output.logprobs or []) + delta.logprobs
                if delta.finish_reason is not None:
                    output.finish_reason, output.stop_reason = delta.finish_reason, \
                        delta.stop_reason
                    if state.stopped_by_string:
                        self.engine.stop_requests([out.request_id])
                    pending -= 1
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _eos_token_ids(model, input_processor: InputProcessor) -> list[int]:
    """EOS ids from the generation config (may be a list), else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = input_processor.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]

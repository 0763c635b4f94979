"""LLM: offline batch generation in one process, like ``vllm.LLM``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenbudget.core.config import CacheConfig, SchedulerConfig
from tokenbudget.core.lora import LoRARequest
from tokenbudget.core.outputs import RequestOutput
from tokenbudget.core.pooling_params import PoolingParams
from tokenbudget.core.request import Request
from tokenbudget.core.sampling_params import SamplingParams
from tokenbudget.server.engine.args import EngineArgs, read_chat_template
from tokenbudget.server.engine.factory import build_engine_core
from tokenbudget.server.engine.input_processor import Prompt
from tokenbudget.server.engine.output_processor import SampleState
from tokenbudget.server.engine.request_builder import build_pooling_request, build_requests
from tokenbudget.server.engine.stop_strings import StopStrings


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
    # Why it failed inside the engine (finish_reason "error"); the other
    # prompts of the call still complete.
    error: str | None = None


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


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """The embedding of one prompt (vLLM's ``EmbeddingRequestOutput``:
    ``outputs.embedding``; ``embedding`` reads it directly)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    num_cached_tokens: int = 0
    finished: bool = True

    @property
    def embedding(self) -> list[float]:
        return self.outputs.embedding

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class LLM:
    """``LLM(model, **engine_args)``: the engine arguments of ``server`` in snake
    case (``EngineArgs``), vLLM's names included: ``max_num_seqs=64``,
    ``num_gpu_blocks_override=512``, ``scheduling_policy="priority"``,
    ``generation_config="vllm"``, ``max_logprobs=5``, and the SGLang-style
    policy options of ``core.config.POLICY_OPTIONS`` (``preemption_mode=
    "retract"``). An unknown keyword is a TypeError; a value we cannot
    honour, a ValueError saying why; a checkpoint that cannot be read, a
    ``ModelLoadError`` (a ValueError) naming the path or id and what to do."""

    def __init__(self, model: str, **engine_args) -> None:
        args = self.engine_args = EngineArgs.from_kwargs(model, **engine_args)
        parts = build_engine_core(args)
        self.engine = parts.core
        self.executor = parts.core.executor
        self.input_processor = parts.input_processor
        self.generation_defaults = parts.generation_defaults
        self.eos_token_ids = parts.generation_defaults.eos_token_ids
        self.pooler_config = parts.pooler_config
        self.structured_output = parts.structured_output
        self._ids = itertools.count()

    def subscribe_kv_events(self, max_pending: int = 1024):
        """A KVEventSubscription (core/kv/events.py) of this engine's KV cache
        events; ``get(timeout)`` returns batches, a snapshot first. Needs
        ``enable_kv_cache_events=True``."""
        sub = self.engine.subscribe_kv_events(max_pending)
        if sub is None:
            raise ValueError("KV cache events are off: pass enable_kv_cache_events=True")
        return sub

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.engine.scheduler_config

    @property
    def cache_config(self) -> CacheConfig:
        """The KV cache's settings, sized as the worker allocated it."""
        return self.engine.cache_config

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses without ``sampling_params``: the model's
        generation_config.json defaults (unless ``generation_config="vllm"``)
        over SamplingParams' own. A SamplingParams you build is used as is."""
        return self.generation_defaults.sampling_params()

    @property
    def tokenizer(self):
        return self.input_processor.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[GenerationResult]:
        """One result per prompt, in input order. ``lora_request``: the LoRA
        adapter of every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"sampling_params: got {len(sampling_params)} for {len(prompts)} prompts"
            )
        loras = _per_prompt_loras(lora_request, len(prompts))
        for lora in set(loras) - {None}:
            self.engine_args.check_adapter(lora)  # a bad adapter fails here, in one line
        results: list[GenerationResult] = []
        # Engine request id -> (its result, its sample's output, its SampleState).
        samples: dict[str, tuple[GenerationResult, CompletionOutput, SampleState]] = {}
        try:
            for prompt, params, lora in zip(prompts, sampling_params, loras):
                self._add(prompt, params, results, samples, lora)
            self._run(samples, use_tqdm)
        except BaseException:
            self.engine.abort_requests(list(samples))
            raise
        return results

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[GenerationResult]:
        """Like vLLM's ``LLM.chat``: one conversation (a list of ``{"role",
        "content"}`` messages) or a list of them, each rendered with the chat
        template (``chat_template``, inline or a file, replaces the
        tokenizer's for this call) and generated; one result per conversation."""
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        template = read_chat_template(chat_template)
        prompts: list[Prompt] = []
        for conversation in conversations:
            prompt: dict = {
                "messages": list(conversation),
                "add_generation_prompt": add_generation_prompt,
            }
            if template is not None:
                prompt["chat_template"] = template
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order. ``pooling_params`` (one
        or one per prompt) override the model's default pooling
        (``self.pooler_config``) field by field. Embedding requests share
        the scheduler with generation: prefill only, chunked like any prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(pooling_params, (list, tuple)):
            pooling_params = [pooling_params] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise ValueError(
                f"pooling_params: got {len(pooling_params)} for {len(prompts)} prompts"
            )
        pending: dict[str, int] = {}
        results: list[EmbeddingRequestOutput | None] = [None] * len(prompts)
        requests = []
        for i, (prompt, params) in enumerate(zip(prompts, pooling_params)):
            rid = f"llm-{next(self._ids)}"
            requests.append(
                build_pooling_request(self.input_processor, rid, prompt, params, self.pooler_config)
            )
            pending[rid] = i
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(prompts), desc="embed")
        try:
            for req in requests:
                self.engine.add_request(req)
            while pending and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    i = pending.pop(out.request_id, None) if out.finished else None
                    if i is None:
                        continue
                    results[i] = _embedding_result(requests[i], out)
                    if progress is not None:
                        progress.update(1)
        except BaseException:
            self.engine.abort_requests(list(pending))
            raise
        finally:
            if progress is not None:
                progress.close()
        return results

    def _make_requests(
        self, prompt: Prompt, params: SamplingParams, lora: LoRARequest | None = None
    ) -> tuple[str, list[Request]]:
        """The id of one prompt's result and its engine requests, one per sample."""
        if params.structured is not None:
            self.structured_output.validate(params.structured)  # a bad spec fails here
        rid = f"llm-{next(self._ids)}"
        return rid, build_requests(
            self.input_processor,
            rid,
            prompt,
            params,
            eos_token_ids=self.eos_token_ids,
            lora_request=lora,
        )

    def _add(
        self,
        prompt: Prompt,
        params: SamplingParams,
        results: list[GenerationResult],
        samples: dict,
        lora: LoRARequest | None = None,
    ) -> None:
        rid, requests = self._make_requests(prompt, params, lora)
        result = GenerationResult(rid, requests[0].prompt_token_ids)
        results.append(result)
        stop_strings = StopStrings(params.stop) if params.stop else None  # shared by the samples
        for i, req in enumerate(requests):
            output = CompletionOutput(i)
            result.outputs.append(output)
            detok = self.input_processor.detokenizer(
                params.skip_special_tokens, params.spaces_between_special_tokens
            )
            samples[req.request_id] = (result, output, SampleState(i, params, detok, stop_strings))
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
                if out.finish_reason == "error" and not state.finished:
                    # It alone failed in the engine: reported, the others go on.
                    output.finish_reason, output.error = "error", str(out.error)
                    state.finished = True
                    pending -= 1
                    if progress is not None:
                        progress.update(1)
                    continue
                if out.error is not None:  # e.g. its grammar failed to compile
                    raise out.error
                if out.prompt_logprobs:
                    result.prompt_logprobs = (
                        result.prompt_logprobs or [None]
                    ) + out.prompt_logprobs
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
                    output.finish_reason, output.stop_reason = (
                        delta.finish_reason,
                        delta.stop_reason,
                    )
                    if state.stopped_by_string:
                        self.engine.stop_requests([out.request_id])
                    pending -= 1
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _embedding_result(req: Request, out: RequestOutput) -> EmbeddingRequestOutput:
    """A finished embedding request's result; RuntimeError if it has no vector."""
    if out.pooling_output is None:
        raise RuntimeError(
            f"embedding request {out.request_id} finished ({out.finish_reason}) without a vector"
        )
    return EmbeddingRequestOutput(
        req.request_id,
        req.prompt_token_ids,
        EmbeddingOutput(out.pooling_output.tolist()),
        max(out.num_cached_tokens, 0),
    )


def _per_prompt_loras(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"lora_request: got {len(loras)} for {n} prompts")
    return loras

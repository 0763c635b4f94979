"""Drives vLLM's V1 Scheduler with the same fake model as
scheduler_overhead.py, for side-by-side numbers. Imported only by
``scheduler_overhead.py --engine vllm`` under a Python that has vllm.

On a machine without a GPU vLLM needs: DeviceConfig(device="cuda"), a tiny
local llama config.json instead of a hub model, skip_tokenizer_init, and
async scheduling off.
"""

from __future__ import annotations

import json
import os
import tempfile

from scheduler_overhead import BLOCK_SIZE, BUDGET, FakeModelDriver


def _tiny_llama_dir() -> str:
    d = tempfile.mkdtemp(prefix="tiny-llama-")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "float16",
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


class VllmEngine(FakeModelDriver):
    name = "vllm"

    def __init__(self, w) -> None:
        import torch
        from vllm import SamplingParams
        from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager

        self.make_output = lambda ids, index, sampled: ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index=index,
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        model_config = ModelConfig(
            model=_tiny_llama_dir(),
            skip_tokenizer_init=True,
            max_model_len=2048,
            dtype="float16",
            seed=0,
        )
        sched_config = SchedulerConfig(
            max_num_seqs=w.max_num_seqs,
            max_num_batched_tokens=BUDGET,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=False,
        )
        cache_config = CacheConfig(
            block_size=BLOCK_SIZE,
            gpu_memory_utilization=0.9,
            cache_dtype="auto",
            enable_prefix_caching=True,
        )
        cache_config.num_gpu_blocks = w.num_blocks
        vconf = VllmConfig(
            model_config=model_config,
            scheduler_config=sched_config,
            cache_config=cache_config,
            device_config=DeviceConfig(device="cuda"),
        )
        kv = KVCacheConfig(
            num_blocks=w.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer0"],
                    FullAttentionSpec(
                        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float16
                    ),
                )
            ],
        )
        self.sched = Scheduler(
            vllm_config=vconf,
            kv_cache_config=kv,
            block_size=BLOCK_SIZE,
            structured_output_manager=StructuredOutputManager(vconf),
            log_stats=True,
        )
        init_none_hash(sha256)
        hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        params = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True)
        for i, p in enumerate(w.prompts):
            self.sched.add_request(
                Request(str(i), p, params, None, arrival_time=float(i), block_hasher=hasher)
            )
        self._preemptions = 0
        self._queries = self._hits = 0

    def schedule(self):
        so = self.sched.schedule()
        self._preemptions += len(getattr(so, "preempted_req_ids", None) or ())
        return so

    def update(self, so, out):
        outs = self.sched.update_from_output(so, out)
        for eco in outs.values():
            stats = getattr(eco, "scheduler_stats", None)
            if stats is not None and stats.prefix_cache_stats is not None:
                self._queries += stats.prefix_cache_stats.queries
                self._hits += stats.prefix_cache_stats.hits

    def stats(self) -> dict:
        rate = self._hits / self._queries if self._queries else 0.0
        return {"prefix_hit_rate": round(rate, 4), "preemptions": self._preemptions}

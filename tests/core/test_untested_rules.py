"""Scheduler and KV rules no other test pinned down: extra keys of block
hashes (LoRA) and the hash algorithm, the admission reserve's ignore_eos and
clip rules, num_common_prefix_blocks, and skipped waiting requests keeping
their place at the head of the queue."""

from __future__ import annotations

import hashlib
import importlib.util
from array import array

import pytest

from tokenbudget.core import CacheConfig, Request, SamplingParams, SchedulerConfig
from tokenbudget.core.kv.hashing import BlockHasher
from tokenbudget.core.policy.reserve import AdmissionReserve
from tokenbudget.core.request import RequestStatus
from tokenbudget.core.sampling_params import StructuredOutputParams


def _request(rid: str, prompt: list[int], lora_id: int | None = None, **sampling) -> Request:
    return Request(rid, prompt, SamplingParams(**sampling), lora_id=lora_id)


# -- block hashes -----------------------------------------------------------------
def test_block_hashes_key_on_the_lora_adapter():
    prompt = list(range(100, 132))  # two full blocks of 16
    hasher = BlockHasher(16)
    base, lora1, lora1_again, lora2 = (
        hasher.update(_request(rid, prompt, lora_id))
        for rid, lora_id in (("a", None), ("b", 1), ("c", 1), ("d", 2))
    )
    assert len(base) == len(lora1) == 2
    assert lora1 == lora1_again  # the same adapter shares its cache
    # Every block differs, not only the first: the adapter changes all of them.
    assert not set(base) & set(lora1) and not set(lora1) & set(lora2)


def test_requests_under_another_lora_get_no_prefix_hits(make_scheduler, step):
    s = make_scheduler(block_size=4, num_blocks=64)
    prompt = list(range(10, 30))
    s.add_request(_request("first", prompt, 1, max_tokens=1))
    step(s)
    step(s)
    s.add_request(_request("same-adapter", prompt, 1, max_tokens=1))
    s.add_request(_request("other-adapter", prompt, 2, max_tokens=1))
    so = s.schedule()
    # 19 tokens can hit at most (the last prompt token runs): 4 full blocks.
    assert so.num_scheduled_tokens == {"same-adapter": 4, "other-adapter": 20}


def test_sha256_block_hash_is_the_documented_chain():
    prompt = list(range(7, 39))
    got = BlockHasher(16).update(_request("a", prompt))
    first = hashlib.sha256(array("q", prompt[:16]).tobytes()).digest()
    second = hashlib.sha256(first + array("q", prompt[16:]).tobytes()).digest()
    assert got == [first, second]


@pytest.mark.skipif(
    importlib.util.find_spec("xxhash") is None,
    reason="xxhash is an optional extra (tokenbudget[fast-hash])",
)
def test_xxhash_block_hash_is_xxh3_128_over_the_same_chain(make_scheduler, step):
    import xxhash

    prompt = list(range(7, 39))
    got = BlockHasher(16, "xxhash", seed=1234).update(_request("a", prompt))
    first = xxhash.xxh3_128_digest(array("q", prompt[:16]).tobytes(), 1234)
    assert got == [first, xxhash.xxh3_128_digest(first + array("q", prompt[16:]).tobytes(), 1234)]
    # And the prefix cache works on it (with this process's random seed).
    s = make_scheduler(block_size=16, hash_algo="xxhash")
    s.add_request(_request("a", prompt, max_tokens=1))
    step(s)
    step(s)
    s.add_request(_request("b", prompt, max_tokens=1))
    assert s.schedule().num_scheduled_tokens == {"b": 16}


def test_xxhash_without_the_package_is_refused_with_the_extra_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "xxhash", None)  # import xxhash raises ImportError
    with pytest.raises(ValueError, match=r"tokenbudget\[fast-hash\]"):
        BlockHasher(16, "xxhash")


# -- admission reserve --------------------------------------------------------------
def _running(rid: str, max_tokens: int, generated: int, ignore_eos: bool) -> Request:
    req = _request(rid, [1, 2, 3], max_tokens=max_tokens, ignore_eos=ignore_eos)
    req.append_output_token_ids([5] * generated)
    return req


def test_reserve_counts_ignore_eos_requests_in_full_and_others_at_the_ratio():
    reserve = AdmissionReserve(
        SchedulerConfig(init_new_token_ratio=0.5, reserve_clip_tokens=10_000), block_size=4
    )
    eos = _running("eos", max_tokens=100, generated=20, ignore_eos=False)  # 80 left
    no_eos = _running("no-eos", max_tokens=100, generated=60, ignore_eos=True)  # 40 left
    assert reserve.future_tokens(eos) == 80 * 0.5
    assert reserve.future_tokens(no_eos) == 40  # always runs to max_tokens
    assert reserve.reserve_blocks([eos, no_eos]) == (80 * 0.5 + 40) / 4


def test_reserve_clips_each_requests_remaining_tokens():
    reserve = AdmissionReserve(
        SchedulerConfig(init_new_token_ratio=0.5, reserve_clip_tokens=30), block_size=4
    )
    eos = _running("eos", max_tokens=1000, generated=0, ignore_eos=False)
    no_eos = _running("no-eos", max_tokens=1000, generated=0, ignore_eos=True)
    short = _running("short", max_tokens=12, generated=2, ignore_eos=True)  # 10 < clip
    assert [reserve.future_tokens(r) for r in (eos, no_eos, short)] == [30 * 0.5, 30, 10]
    assert reserve.reserve_blocks([eos, no_eos, short]) == (30 * 0.5 + 30 + 10) / 4


def test_reserve_ratio_decays_to_its_floor():
    reserve = AdmissionReserve(
        SchedulerConfig(
            init_new_token_ratio=0.5, min_new_token_ratio=0.3, new_token_ratio_decay=0.125
        ),
        block_size=4,
    )
    ratios = []
    for _ in range(3):
        reserve.on_step()
        ratios.append(reserve.ratio)
    assert ratios == [0.375, 0.3, 0.3]


# -- num_common_prefix_blocks --------------------------------------------------------
def test_num_common_prefix_blocks_counts_blocks_every_running_request_shares(make_scheduler, step):
    s = make_scheduler(block_size=4, num_blocks=64, max_num_batched_tokens=1000)
    shared = list(range(50, 62))  # 3 full blocks
    s.add_request(_request("a", shared + [1, 2, 3, 4, 5], max_tokens=50))
    so, _ = step(s)
    assert so.num_common_prefix_blocks == 5  # one running request: all its blocks
    s.add_request(_request("b", shared + [9, 9, 9], max_tokens=50))
    so, _ = step(s)
    assert so.num_common_prefix_blocks == 3
    s.add_request(_request("c", list(range(200, 210)), max_tokens=50))
    so, _ = step(s)
    assert so.num_common_prefix_blocks == 0  # c shares nothing


def test_num_common_prefix_blocks_is_zero_without_prefix_caching(make_scheduler, step):
    s = make_scheduler(block_size=4, num_blocks=64, enable_prefix_caching=False)
    s.add_request(_request("a", list(range(50, 62)), max_tokens=5))
    so, _ = step(s)
    assert so.num_common_prefix_blocks == 0


# -- skipped waiting requests -----------------------------------------------------------
class _GrammarsNeverReady:
    """A structured-output manager whose grammars are still compiling."""

    def add_request(self, request):
        pass

    def remove_request(self, request):
        pass

    def is_ready(self, request):
        return False

    def take_failed(self):
        return []

    def grammar_bitmask(self, requests, scheduled, spec):
        return None, []


def test_skipped_waiting_requests_return_to_the_head_of_the_queue_in_order():
    from tokenbudget.core import Scheduler

    s = Scheduler(
        SchedulerConfig(max_num_seqs=2),
        CacheConfig(block_size=4, num_blocks=64),
        _GrammarsNeverReady(),
    )
    json = StructuredOutputParams(json_object=True)
    for rid in ("s1", "a", "s2", "b", "c"):
        structured = json if rid.startswith("s") else None
        s.add_request(_request(rid, [1, 2, 3, 4, 5], max_tokens=4, structured=structured))
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["a", "b"]  # two seats; s1, s2 compile
    waiting = [r.request_id for r in s.waiting]
    assert waiting == ["s1", "s2", "c"]
    assert s.requests["s1"].status == RequestStatus.WAITING_FOR_FSM

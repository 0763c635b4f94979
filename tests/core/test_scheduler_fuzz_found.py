"""Cases the scheduler fuzz (test_scheduler_fuzz.py) found that are not fixed
yet, kept as exact replays: each is a strict xfail, so a fix turns it into a
failure that says to make it a plain test."""

from __future__ import annotations

import pytest

from tests.core.test_scheduler_fuzz import SchedulerMachine
from tokenbudget.core import CacheConfig, SchedulerConfig


@pytest.mark.xfail(
    strict=True,
    reason="async + 1 n-gram draft near max_tokens: the engine "
    "expects a token the worker was never asked for (WorkerReplyError)",
)
def test_async_one_draft_request_near_max_tokens_gets_its_last_token():
    """Found after the fuzz's examples changed (2026-11-27); present before
    this round's restructuring (the layout move, c3151db, fails it too)."""
    state = SchedulerMachine()
    state.setup(
        config=(
            SchedulerConfig(
                max_num_batched_tokens=7,
                max_num_seqs=4,
                max_model_len=38,
                long_prefill_token_threshold=5,
                policy="fcfs",
                priority_preemption_threshold=-1,
                speculative_config={
                    "method": "ngram",
                    "num_speculative_tokens": 1,
                    "prompt_lookup_min": 5,
                    "prompt_lookup_max": 5,
                },
                async_scheduling=True,
            ),
            CacheConfig(block_size=8, num_blocks=8, enable_prefix_caching=False),
            False,
            False,
        ),
        seed=0,
        tick_s=0.001,
        came_back_smaller=False,
    )
    one = (1, False, 1, 0, False, None)
    state.add(batch=[one, one, (1, False, 4, 0, False, None), (2, False, 10, 0, False, None)])
    state.step(n=1)
    state.add(batch=[one, one, one, (38, False, 1, 0, False, None)])
    state.add(batch=[one, (1, False, 4, 0, False, None)])
    state.step(n=1)
    state.step(n=1)
    state.add(batch=[one, one])
    state.step(n=1)
    state.step(n=6)
    state.teardown()


def test_token_outside_the_grammar_fails_its_request_without_keeping_the_token():
    """Found by reseeding the fuzz (2026-11-28): a request whose worker sampled
    a token its grammar refuses (the fake worker samples EOS where a rejected
    draft was the only token allowed) failed with the token still in its
    output_token_ids, though its reader never got it."""
    from tests.core.test_scheduler_fuzz import EOS, VOCAB, TinyVocabOutputs
    from tokenbudget.core import ModelRunnerOutput, Request, SamplingParams, Scheduler

    som = TinyVocabOutputs(None, len(VOCAB), compile_threads=1, fill_threads=1)
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=16, max_model_len=32),
        CacheConfig(block_size=2, num_blocks=17),
        som,
    )
    params = SamplingParams(max_tokens=8, ignore_eos=True, structured={"regex": "(ab|c)+1"})
    req = Request("r", [1, 2, 3], params, eos_token_id=EOS)
    s.add_request(req)
    som.wait_for_compiles(10.0)
    streamed: list[int] = []
    for tokens in ([1], [2], [EOS]):  # "a", "b", then EOS where "c" or "a" or "1" must come
        so = s.schedule()
        assert so.structured_req_ids == ["r"]
        (out,) = s.update_from_output(so, ModelRunnerOutput(["r"], {"r": 0}, [tokens]))
        streamed += out.new_token_ids
    assert out.finish_reason == "error" and "token 0" in str(out.error)
    assert streamed == req.output_token_ids == [1, 2]
    assert req.all_token_ids == [1, 2, 3, 1, 2]
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 16
    som.shutdown()

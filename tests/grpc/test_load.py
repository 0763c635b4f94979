"""64 concurrent streaming clients x 20 requests against a real server."""

from __future__ import annotations

import random
import threading

from tokenbudget.core import SamplingParams
from tokenbudget.server.entrypoints.client import Client

NUM_CLIENTS = 64
REQUESTS_PER_CLIENT = 20


def test_64_streaming_clients_get_exactly_their_tokens_and_leave_every_block_free(cluster, oracle):
    rng = random.Random(0)
    # A few distinct prompts (shared prefixes hit the prefix cache), several lengths.
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(4, 40))] for _ in range(16)]
    max_tokens = [1 + i % 6 for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    want = [
        r.token_ids for r in oracle.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]

    failures: list[str] = []
    completed: list[str] = []
    lock = threading.Lock()

    def client_loop(cid: int) -> None:
        r = random.Random(cid)
        with Client(cluster.local.address) as c:
            for n in range(REQUESTS_PER_CLIENT):
                k = r.randrange(len(prompts))
                rid = f"c{cid}-r{n}"
                try:
                    tokens, finished = [], 0
                    for msg in c.generate_stream(prompts[k], params[k], request_id=rid):
                        assert msg.request_id == rid
                        tokens.extend(msg.token_ids)
                        finished += bool(msg.finish_reason)
                    if tokens != want[k] or finished != 1:
                        raise AssertionError(
                            f"{rid}: got {tokens} (finished {finished}), want {want[k]}"
                        )
                    with lock:
                        completed.append(rid)
                except Exception as e:  # noqa: BLE001 - collected and reported below
                    with lock:
                        failures.append(f"{rid}: {e}")

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(NUM_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not failures, failures[:5]
    # Every client finished (a hung or silently dead thread is a failure too).
    assert not [t for t in threads if t.is_alive()]
    assert len(completed) == NUM_CLIENTS * REQUESTS_PER_CLIENT
    with Client(cluster.local.address) as c:
        s = c.stats()
    assert s.num_requests == 0 and s.num_running == 0 and s.num_waiting == 0
    assert s.num_free_blocks == s.num_total_blocks
    assert s.prefix_cache_hits > 0

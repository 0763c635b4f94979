"""Many replicas behind the gateway: cache-aware routing keeps a prefix on the
replica that holds it; a replica killed mid-request fails its requests with
an error (no hang) and the survivor serves what comes next."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time

from tokenbudget.server.entrypoints.client import Client

BLOCK = 16


def prefix(i: int) -> str:
    # Distinct from the first words on, a few hundred tokens long.
    return f"Tenant {i} system prompt. " + " ".join(f"rule{i}-{k}" for k in range(60))


def test_requests_sharing_a_prefix_go_to_the_replica_that_holds_it(cluster, clients):
    gw = cluster.gateway
    before = {name: c.stats().prefix_cache_queries for name, c in clients.items()}
    first: dict[int, int] = {}
    cached: list[int] = []

    def ask(i: int) -> None:
        status, out = gw.post(
            "/generate",
            {
                "model": gw.model,
                "text": prefix(i) + " Hello.",
                "sampling_params": {"max_new_tokens": 64, "ignore_eos": True},
            },
        )
        assert status == 200, out
        first[i] = out[0]["meta_info"]["prompt_tokens"]

    # At once: with no cached match the gateway picks the least loaded replica
    # (one at a time, every new prefix would go to the first replica: loads tie).
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(first) == 4
    # Distinct prefixes are spread: both replicas computed some of them.
    assert all(c.stats().prefix_cache_queries > before[name] for name, c in clients.items())
    for round_ in range(2):
        for i in range(4):
            status, out = gw.post(
                "/generate",
                {
                    "model": gw.model,
                    "text": prefix(i) + f" Question {round_}?",
                    "sampling_params": {"max_new_tokens": 2},
                },
            )
            assert status == 200, out
            cached.append(out[0]["meta_info"]["cached_tokens"])
    # Each follow-up found its prefix's full blocks cached: it went where the prefix is.
    shortest = min(first.values()) - 8  # the suffixes differ in their last few tokens
    assert all(c >= (shortest // BLOCK - 1) * BLOCK for c in cached), (cached, first)


def _stream_until_done(gw, body: dict, results: list, started: threading.Event) -> None:
    """Stream a /generate request; record ("ok", n tokens) or ("error", what)."""
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=60)
    try:
        conn.request(
            "POST",
            "/generate",
            json.dumps({**body, "stream": True}),
            {"Content-Type": "application/json"},
        )
        r = conn.getresponse()
        if r.status != 200:
            results.append(("error", r.status))
            return
        tokens, done = 0, False
        for line in r:
            if line.startswith(b"data: [DONE]"):
                done = True
                break
            if line.startswith(b"data: "):
                if b'"error"' in line:  # the gateway's error event (not always valid JSON)
                    results.append(("error", line.decode(errors="replace")))
                    return
                event = json.loads(line[6:])
                tokens += len(event.get("output_ids", []))
                started.set()
        results.append(("ok", tokens) if done else ("error", "stream ended without [DONE]"))
    except (OSError, http.client.HTTPException) as exc:
        results.append(("error", repr(exc)))
    finally:
        conn.close()


def test_a_killed_replica_fails_its_requests_and_the_survivor_serves_new_ones(cluster):
    gw = cluster.kill_gateway
    victim = Client(cluster.victim.address)
    body = {
        "model": gw.model,
        "text": "tell me everything",
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0},
    }
    results: list = []
    threads = []
    for _ in range(4):  # round_robin: two on each replica
        started = threading.Event()
        t = threading.Thread(target=_stream_until_done, args=(gw, body, results, started))
        t.start()
        threads.append((t, started))
    for _, started in threads:
        assert started.wait(30)
    assert victim.stats().num_running == 2
    victim.close()
    cluster.victim.proc.send_signal(signal.SIGKILL)
    for t, _ in threads:
        t.join(90)
        assert not t.is_alive(), "a request hung after its replica died"
    kinds = sorted(kind for kind, _ in results)
    assert kinds == ["error", "error", "ok", "ok"], results
    assert [n for kind, n in results if kind == "ok"] == [2000, 2000]
    # New requests: every one served (by the survivor; the dead one is retried past).
    for i in range(4):
        status, out = gw.post(
            "/generate",
            {"model": gw.model, "text": f"after {i}", "sampling_params": {"max_new_tokens": 3}},
            timeout=60,
        )
        assert status == 200 and len(out[0]["output_ids"]) == 3, out
    deadline = time.monotonic() + 30
    while gw.healthy_workers() != {f"grpc://{cluster.r1.address}"}:
        assert time.monotonic() < deadline, gw.get("/workers")
        time.sleep(0.2)

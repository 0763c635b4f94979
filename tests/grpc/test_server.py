"""A real `server` process (tiny Qwen3, in-process worker) against the in-process LLM."""

from __future__ import annotations

import os
import threading
import time
import urllib.request
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tokenbudget.core import SamplingParams
from tokenbudget.proto import common_pb2, generate_pb2, sglang_scheduler_pb2_grpc
from tokenbudget.proto import sglang_scheduler_pb2 as sgl
from tokenbudget.server.entrypoints.client import Client, make_request

from .conftest import listening_addresses

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _stream(client, prompt, params=GREEDY, **kw):
    return list(client.generate_stream(prompt, params, **kw))


def _collect(msgs):
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs)


def _wait_all_blocks_free(client, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        s = client.stats()
        if s.num_requests == 0 and s.num_free_blocks == s.num_total_blocks:
            return s
        assert time.monotonic() < deadline, f"blocks still held: {s}"
        time.sleep(0.05)


def _wait_for_num_requests(client, n, timeout=5.0):
    deadline = time.monotonic() + timeout
    while (s := client.stats()).num_requests != n:
        assert time.monotonic() < deadline, f"{s.num_requests} requests, expected {n}"
        time.sleep(0.01)


def test_health_is_serving_and_reflection_lists_the_public_services_only(cluster):
    with grpc.insecure_channel(cluster.local.address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"tokenbudget.v1.Generation", "grpc.health.v1.Health"} <= names
    # The worker's control plane is not served on the public port, nor advertised.
    assert "tokenbudget.v1.Worker" not in names


def test_streamed_text_generation_equals_in_process_llm(client, oracle):
    prompts = [
        "Hello! How are you today?",
        "The scheduler hands out a budget of tokens",
        "Unicode: café 東京 🙂 " * 6,
    ]
    want = oracle.generate(prompts, GREEDY)
    for prompt, ref in zip(prompts, want):
        msgs = _stream(client, prompt)
        tokens, text = _collect(msgs)
        assert tokens == ref.token_ids
        assert text == ref.text  # incremental deltas add up to the full decode
        last = msgs[-1]
        assert last.finish_reason == ref.finish_reason == "length"
        assert last.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert last.usage.completion_tokens == len(ref.token_ids)
        assert all(not m.finish_reason for m in msgs[:-1])


def test_token_id_prompts_and_chat_messages_equal_in_process_llm(client, oracle):
    ids = [5, 17, 300, 42, 42, 7] * 12  # longer than the 64-token budget: chunked
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    want = oracle.generate([{"prompt_token_ids": ids}, {"messages": messages}], GREEDY)
    got_ids, _ = _collect(_stream(client, ids))
    got_chat, chat_text = _collect(_stream(client, {"messages": messages}))
    assert got_ids == want[0].token_ids
    assert got_chat == want[1].token_ids and chat_text == want[1].text


def test_non_streaming_generate_reports_usage_and_cached_tokens(client, oracle):
    prompt = list(range(10, 60))  # 50 tokens: 3 full blocks can be reused
    first = client.generate(prompt, GREEDY)
    second = client.generate(prompt, GREEDY)
    assert (
        first.token_ids
        == second.token_ids
        == oracle.generate({"prompt_token_ids": prompt}, GREEDY)[0].token_ids
    )
    assert (second.prompt_tokens, second.completion_tokens) == (50, 12)
    assert second.cached_tokens == 48


def _bad(**fields) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(**fields)


def _sp(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**kw)


BAD_INPUTS = {
    "empty text": (_bad(text=""), "text"),
    "empty token ids": (_bad(token_ids=common_pb2.TokenIds(ids=[])), "token_ids"),
    "no input": (_bad(), "input"),
    "prompt longer than max_model_len": (
        _bad(token_ids=common_pb2.TokenIds(ids=[5] * 4097)),
        "max_model_len",
    ),
    "max_tokens 0": (_bad(text="hi", sampling_params=_sp(max_tokens=0)), "max_tokens"),
    "max_tokens negative": (_bad(text="hi", sampling_params=_sp(max_tokens=-3)), "max_tokens"),
    "temperature < 0": (_bad(text="hi", sampling_params=_sp(temperature=-0.5)), "temperature"),
    "top_p 0": (_bad(text="hi", sampling_params=_sp(top_p=0.0)), "top_p"),
    "top_p > 1": (_bad(text="hi", sampling_params=_sp(top_p=1.5)), "top_p"),
    "top_k < -1": (_bad(text="hi", sampling_params=_sp(top_k=-2)), "top_k"),
    "token id >= vocab": (_bad(token_ids=common_pb2.TokenIds(ids=[1, 10**6])), "token_ids"),
    "negative token id": (_bad(token_ids=common_pb2.TokenIds(ids=[-1])), "token_ids"),
    "empty request id": (_bad(text="hi", request_id=""), "request_id"),
    "image for a text model": (_bad(text="hi", images=[b"\x89PNG"]), "images"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_invalid_argument_naming_the_field_and_server_keeps_serving(client, name):
    request, field = BAD_INPUTS[name]
    with pytest.raises(grpc.RpcError) as err:
        list(client.stub.Generate(request))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    assert client.generate("still serving?", GREEDY).completion_tokens == 12


def test_message_over_the_size_limit_is_resource_exhausted(client):
    big = _bad(text="x" * (2 << 20))  # the server's limit is 1 MiB
    with pytest.raises(grpc.RpcError) as err:
        list(client.stub.Generate(big))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.generate("still serving?", GREEDY).completion_tokens == 12


def _start_long(client, request_id: str):
    """A stream that runs for a while, and its first response."""
    params = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    call = client.stub.Generate(make_request("a long story", params, request_id=request_id))
    first = next(call)
    return call, first


def test_abort_ends_the_stream_and_frees_its_blocks_and_unknown_ids_are_not_found(client):
    call, first = _start_long(client, "to-abort")
    assert first.request_id == "to-abort"
    assert client.stats().num_free_blocks < client.stats().num_total_blocks
    client.abort("to-abort")
    rest = list(call)
    assert rest[-1].finish_reason == "abort"
    _wait_all_blocks_free(client, timeout=2.0)
    with pytest.raises(grpc.RpcError) as err:
        client.abort("to-abort")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "to-abort" in err.value.details()


def test_another_client_cannot_abort_a_request_whose_id_it_does_not_know(cluster, client):
    # The documented model (README, Security): no per-client ownership, but an
    # id the server picks is a random uuid4 only the request's own stream sees.
    params = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    call = client.stub.Generate(make_request("a long story", params))
    rid = next(call).request_id
    other_call = client.stub.Generate(make_request("another story", params))
    other_rid = next(other_call).request_id
    other_call.cancel()
    # The cancel reaches the server asynchronously: until it has, other_rid is
    # still live there and a stranger's abort of it would succeed.
    _wait_for_num_requests(client, 1)
    assert uuid.UUID(hex=rid).version == 4 and len(rid) == 32 and rid != other_rid
    guesses = ["0", "1", "request-0", rid[:-1] + ("0" if rid[-1] != "0" else "1"), other_rid]
    with Client(cluster.local.address) as stranger:
        for guess in guesses:
            with pytest.raises(grpc.RpcError) as err:
                stranger.abort(guess)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND, guess
        assert next(call).finish_reason == ""  # still generating
        stranger.abort(rid)  # whoever knows the id can end it
    assert list(call)[-1].finish_reason == "abort"
    _wait_all_blocks_free(client)


def test_grpc_and_metrics_ports_listen_on_loopback_only_by_default(cluster):
    # The worker's port: tests/faults/test_worker_faults.py (this cluster's
    # worker is killed by test_remote_worker.py).
    for name, port in (("gRPC", cluster.local.port), ("metrics", cluster.metrics_port)):
        assert listening_addresses(port) == {"127.0.0.1"}, name


def test_duplicate_live_request_id_is_already_exists(client):
    call, _ = _start_long(client, "dup")
    try:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("again", GREEDY, request_id="dup")
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "dup" in err.value.details()
    finally:
        call.cancel()
    _wait_all_blocks_free(client)


def _start_long_sglang(client, request_id: str):
    """The same through the SGLang gateway's worker protocol (same port), as the gateway sends
    it; the stream and its first response."""
    stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(client.channel)
    call = stub.Generate(
        sgl.GenerateRequest(
            request_id=request_id,
            tokenized=sgl.TokenizedInput(input_ids=list(range(40, 90))),
            sampling_params=sgl.SamplingParams(
                max_new_tokens=3000, ignore_eos=True, top_p=1.0, repetition_penalty=1.0
            ),
            stream=True,
        )
    )
    first = next(call)
    assert first.WhichOneof("response") == "chunk", first
    return call, first


@pytest.mark.parametrize("start", [_start_long, _start_long_sglang], ids=["Generation", "SGLang"])
def test_client_cancellation_frees_kv_within_a_step(client, start):
    """A client that cancels its stream mid-generation, with no Abort sent by anyone (the
    gateway's own Abort hides this path in tests/gateway): its request is gone and its KV free
    within a step, long before its 3000 tokens.

    Break this catches (tried, for each service): the servicer's Generate no longer aborting
    a stream that ended unfinished (its ``finally``)."""
    _wait_all_blocks_free(client)
    generated = client.stats().num_generated_tokens
    call, _ = start(client, "to-cancel")
    assert client.stats().num_requests == 1
    call.cancel()
    _wait_all_blocks_free(client, timeout=2.0)
    with pytest.raises(grpc.RpcError) as err:
        client.abort("to-cancel")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert client.stats().num_generated_tokens - generated < 1000


def _metrics(cluster) -> dict[str, float]:
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10)
        .read()
        .decode()
    )
    return {
        line.split("{")[0].removeprefix("tokenbudget:"): float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith("tokenbudget:") and "{" in line
    }


def _metrics_when(cluster, ready, timeout: float = 10.0) -> dict[str, float]:
    """The first scrape for which ``ready(values)`` holds (the engine thread
    refreshes its gauges at most every 0.25 s)."""
    deadline = time.monotonic() + timeout
    while not ready(values := _metrics(cluster)):
        assert time.monotonic() < deadline, f"metrics never got there: {values}"
        time.sleep(0.02)
    return values


def test_metrics_endpoint_counts_generated_tokens_prefix_cache_and_latencies(cluster, client):
    _wait_all_blocks_free(client)
    before = _metrics(cluster)
    # A prompt no other test sends, twice: the first run queries its 50 tokens
    # and hits nothing, the second hits its 3 full blocks (never the last token).
    prompt = list(range(700, 750))
    client.generate(prompt, GREEDY)
    client.generate(prompt, GREEDY)
    after = _metrics_when(
        cluster,
        lambda v: v["prefix_cache_queries_total"] >= before["prefix_cache_queries_total"] + 100,
    )

    def delta(name):
        return after[name] - before[name]

    assert delta("prefix_cache_queries_total") == 100
    assert delta("prefix_cache_hits_total") == 48
    assert after["prefix_cache_hit_rate"] == pytest.approx(
        after["prefix_cache_hits_total"] / after["prefix_cache_queries_total"]
    )
    assert delta("generation_tokens_total") == 2 * GREEDY.max_tokens
    assert after["generation_tokens_total"] == client.stats().num_generated_tokens
    for name in (
        "e2e_request_latency_seconds_count",
        "time_to_first_token_seconds_count",
        "time_per_output_token_seconds_count",
    ):
        assert delta(name) == 2, name
    assert delta("e2e_request_latency_seconds_sum") > 0
    assert delta("num_preemptions_total") == 0


def test_metrics_gauges_rise_while_a_request_runs_and_drop_to_zero_when_idle(cluster, client):
    call, _ = _start_long(client, "gauges")
    try:
        # Written while the request runs (they start at 0: this is what makes
        # the drop below mean anything).
        busy = _metrics_when(cluster, lambda v: v["num_requests_running"] == 1)
        assert busy["kv_cache_usage_perc"] > 0
        assert busy["num_requests_waiting"] == 0
    finally:
        call.cancel()
    idle = _metrics_when(cluster, lambda v: v["num_requests_running"] == 0)
    assert idle["num_requests_waiting"] == 0
    assert idle["kv_cache_usage_perc"] == 0


def test_busy_poll_runs_one_idle_priority_spinner_per_cpu_beside_the_server(cluster):
    from tokenbudget.worker.idle_poll import idle_priority_threads as idle_threads

    spare = cluster.spare
    if spare.proc.poll() is not None:
        pytest.skip("the drain test has stopped the spare server")
    cpus = sorted(os.sched_getaffinity(spare.proc.pid))
    spinners = idle_threads(spare.proc.pid)
    assert sorted(c for a in spinners.values() for c in a) == cpus
    assert f"busy polling: an idle-priority spinning thread on each of CPUs {cpus}" in "".join(
        spare.log
    )
    with Client(spare.address) as c:  # and it serves
        out = c.generate("spin", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert out.completion_tokens == 8
    # The servers without --busy-poll have none.
    assert idle_threads(cluster.local.proc.pid) == {}


def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_0(cluster):
    from tokenbudget.server.entrypoints.client import Client

    spare = cluster.spare
    with Client(spare.address) as c:
        params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
        results: list = []
        t = threading.Thread(target=lambda: results.append(c.generate("drain me", params)))
        t.start()
        deadline = time.monotonic() + 30
        while c.stats().num_requests == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        spare.proc.terminate()
        time.sleep(0.3)  # the signal handler flips the server into draining
        with pytest.raises(grpc.RpcError) as err:
            c.generate("too late", GREEDY)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        t.join(60)
    assert results and results[0].completion_tokens == 1000 and results[0].finish_reason == "length"
    assert spare.proc.wait(30) == 0

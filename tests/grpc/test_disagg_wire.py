"""Disaggregated prefill/decode over the wire and at the edges: its fields
of the worker protocol round-trip (KV sends and cancels on every kind of
step, finished and failed sends, handshakes, the transfer backend), several
workers' reports merge into the engine's (a send is done once every worker
reported it), the flags parse and refuse contradictions in one line, and
the gateway handler turns a Generate into each half's request, and what
disaggregation cannot serve yet is refused before the weights load."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from tokenbudget.core import CacheConfig, SamplingParams, SchedulerConfig
from tokenbudget.core.kv.connector import DECODE, PREFILL, KVConnectorMetadata, KVSend
from tokenbudget.core.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tokenbudget.proto import convert, sglang_scheduler_pb2 as sg, step_stream, worker_pb2
from tokenbudget.proto import worker_pb2_grpc
from tokenbudget.proto.kv_connector import KVSendTally
from tokenbudget.server.engine.args import EngineArgs
from tokenbudget.server.entrypoints import cli
from tokenbudget.server.entrypoints.grpc.sglang_convert import gateway_request
from tokenbudget.server.executor.remote import RemoteExecutor

SEND = KVSend("r0", [3, 4, 5, 9], [11, 12, 13, 2], [b"rank0-\x00\xff", b"rank1"])


def _wire():
    enc, dec = step_stream.SchedulerOutputEncoder(), step_stream.SchedulerOutputDecoder()

    def send(so: SchedulerOutput) -> tuple[worker_pb2.SchedulerOutput, SchedulerOutput]:
        msg = worker_pb2.SchedulerOutput.FromString(enc.encode(so).SerializeToString())
        return msg, dec.decode(msg)

    return send


def _new(rid: str, output_token_ids: list[int] | None = None) -> NewRequestData:
    return NewRequestData(
        rid,
        [1, 2, 3, 4, 5],
        [],
        SamplingParams(max_tokens=4),
        [7, 8],
        5 if output_token_ids else 0,
        output_token_ids=list(output_token_ids or []),
    )


def test_a_decode_requests_first_token_and_the_kv_sends_cross_every_kind_of_step():
    send = _wire()
    meta = KVConnectorMetadata(sends=[SEND], cancels=["gone", "also-gone"])
    # A decode's request arrives with the first token the prefill sampled.
    so = SchedulerOutput(
        [_new("a", [42]), _new("b")],
        CachedRequestData(),
        {"a": 1, "b": 5},
        6,
        kv_connector_metadata=meta,
    )
    _, back = send(so)
    assert [r.output_token_ids for r in back.scheduled_new_reqs] == [[42], []]
    assert back.kv_connector_metadata == meta
    # A steady step (sent as a repeat of the last) still carries its sends.
    steady = SchedulerOutput(
        [],
        CachedRequestData(["a", "b"], [[], []], [6, 10]),
        {"a": 1, "b": 1},
        2,
        kv_connector_metadata=KVConnectorMetadata(sends=[SEND]),
    )
    msg, back = send(steady)
    steady2 = SchedulerOutput(
        [], CachedRequestData(["a", "b"], [[], []], [7, 11]), {"a": 1, "b": 1}, 2
    )
    steady2.kv_connector_metadata = KVConnectorMetadata()  # empty: a poll for reports
    msg2, back2 = send(steady2)
    assert msg2.repeats_last_step
    assert back.kv_connector_metadata == KVConnectorMetadata(sends=[SEND])
    assert back2.kv_connector_metadata == KVConnectorMetadata()  # present, not None
    # An empty step with metadata (the engine polls while transfers are pending).
    poll = SchedulerOutput([], CachedRequestData(), {}, 0)
    poll.kv_connector_metadata = KVConnectorMetadata(cancels=["r0"])
    _, back = send(poll)
    assert back.is_empty and back.kv_connector_metadata == KVConnectorMetadata(cancels=["r0"])
    # Without a connector nothing travels and nothing comes back.
    msg, back = send(SchedulerOutput([], CachedRequestData(), {}, 0))
    assert not msg.HasField("kv_connector_metadata") and back.kv_connector_metadata is None


def test_a_send_with_mismatched_block_lists_is_refused_naming_the_request():
    send = _wire()
    so = SchedulerOutput([], CachedRequestData(), {}, 0)
    so.kv_connector_metadata = KVConnectorMetadata(sends=[KVSend("r9", [1, 2], [3], [b"x"])])
    with pytest.raises(ValueError, match="'r9': 2 source blocks but 1 destination"):
        send(so)


def test_finished_and_failed_sends_round_trip_and_empty_reports_are_none():
    out = ModelRunnerOutput(
        ["a"],
        {"a": 0},
        [[5]],
        finished_sending={"r1", "r2"},
        failed_sending={"r3": "peer unreachable"},
    )
    msg = step_stream.model_runner_output_to_proto(out, 1, ["a"])
    back = step_stream.ModelRunnerOutputDecoder().decode(
        worker_pb2.ModelRunnerOutput.FromString(msg.SerializeToString()), ["a"]
    )
    assert back.finished_sending == {"r1", "r2"}
    assert back.failed_sending == {"r3": "peer unreachable"}
    plain = step_stream.ModelRunnerOutputDecoder().decode(
        step_stream.model_runner_output_to_proto(ModelRunnerOutput(["a"], {"a": 0}, [[5]]))
    )
    assert plain.finished_sending is None and plain.failed_sending is None


def test_the_transfer_backend_reaches_the_worker_in_initialize():
    cache = CacheConfig(block_size=16, num_blocks=64, kv_transfer_backend="nixl")
    sched = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2, max_model_len=128)
    msg = worker_pb2.InitializeRequest(model="m")
    convert.configs_to_proto(cache, sched, msg)
    back = worker_pb2.InitializeRequest.FromString(msg.SerializeToString())
    assert back.cache_config.kv_transfer_backend == "nixl"
    assert convert.configs_from_proto(back) == (cache, sched)
    msg.cache_config.kv_transfer_backend = "carrier-pigeon"
    with pytest.raises(ValueError, match="cache_config.kv_transfer_backend"):
        convert.configs_from_proto(msg)


def test_a_send_is_done_once_every_worker_reported_it_and_failed_if_any_failed():
    tally = KVSendTally(3)
    # Rank 0 finishes r1 a step before the others; r2 fails on rank 1 while
    # ranks 0 and 2 still write: it is not done until they stop.
    assert tally.merge([({"r1"}, None), (None, None), (None, None)]) == (None, None)
    assert tally.merge(
        [({"r2"}, None), ({"r1"}, {"r2": "rank 1: NIXL error"}), ({"r1"}, None)]
    ) == ({"r1"}, None)
    assert tally.merge([(None, None), (None, None), (None, {"r2": "rank 2 too"})]) == (
        None,
        {"r2": "rank 1: NIXL error"},
    )
    # A request id reused later starts from nothing.
    assert tally.merge([({"r1"}, None)] * 3) == ({"r1"}, None)


class _Worker(worker_pb2_grpc.WorkerServicer):
    """Answers Initialize with its handshake and every step with the sends
    scripted for it (step id -> (finished, failed))."""

    def __init__(self, handshake: bytes, script: dict[int, tuple[set, dict]]) -> None:
        self.handshake, self.script = handshake, script
        self.backend = None

    def Initialize(self, request, context):
        self.backend = request.cache_config.kv_transfer_backend
        return worker_pb2.InitializeResponse(num_blocks=9, kv_transfer_handshakes=[self.handshake])

    def ExecuteModel(self, request_iterator, context):
        decoder = step_stream.SchedulerOutputDecoder()
        for msg in request_iterator:
            so = decoder.decode(msg)
            assert so.kv_connector_metadata is not None
            done, failed = self.script.get(msg.step_id, (set(), {}))
            out = ModelRunnerOutput([], {}, [], finished_sending=done, failed_sending=failed)
            yield step_stream.model_runner_output_to_proto(out, msg.step_id, [])


def test_remote_workers_handshakes_come_in_rank_order_and_their_sends_merge():
    scripts = [
        {1: ({"x"}, {}), 2: ({"y"}, {})},
        {1: (set(), {}), 2: ({"x"}, {"y": "worker 1 lost its peer"})},
    ]
    workers = [_Worker(f"hs{i}".encode(), scripts[i]) for i in range(2)]
    servers, addresses = [], []
    for w in workers:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        worker_pb2_grpc.add_WorkerServicer_to_server(w, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    ex = RemoteExecutor(addresses, "m", connect_timeout=10)
    try:
        spec = ex.initialize(
            CacheConfig(block_size=16, kv_transfer_backend="nixl"),
            SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2, max_model_len=64),
        )
        assert spec.kv_transfer_handshakes == (b"hs0", b"hs1")
        assert [w.backend for w in workers] == ["nixl", "nixl"]
        outs = []
        for _ in range(2):
            so = SchedulerOutput([], CachedRequestData(), {}, 0)
            so.kv_connector_metadata = KVConnectorMetadata()
            outs.append(ex.execute_model(so).result(10))
        assert (outs[0].finished_sending, outs[0].failed_sending) == (None, None)
        assert outs[1].finished_sending == {"x"}
        assert outs[1].failed_sending == {"y": "worker 1 lost its peer"}
    finally:
        ex.shutdown()
        for s in servers:
            s.stop(0)


# -- flags -------------------------------------------------------------------------------

PRODUCER = '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'


def _args(*argv: str) -> EngineArgs:
    return EngineArgs.from_cli_args(cli.build_parser().parse_args(list(argv)))


def test_vllms_kv_transfer_config_says_what_the_sglang_flags_say():
    vllm = _args("--kv-transfer-config", PRODUCER).disaggregation_config
    sglang = _args("--disaggregation-mode", "prefill").disaggregation_config
    assert (vllm.mode, vllm.transfer_backend) == (sglang.mode, sglang.transfer_backend)
    assert (vllm.mode, vllm.transfer_backend) == (PREFILL, "nixl")
    consumer = PRODUCER.replace("kv_producer", "kv_consumer")
    assert _args("--kv-transfer-config", consumer).disaggregation_config.mode == DECODE
    assert EngineArgs.from_kwargs("m", kv_transfer_config=consumer).kv_transfer_config == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
    }
    args = _args(
        "--disaggregation-mode",
        "decode",
        "--disaggregation-bootstrap-port",
        "9100",
        "--disaggregation-timeout",
        "5",
    )
    config = args.disaggregation_config
    assert (config.mode, config.disaggregation_bootstrap_port, config.disaggregation_timeout) == (
        DECODE,
        9100,
        5.0,
    )
    assert not _args().disaggregation_config.enabled


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"disaggregation_mode": "decode", "kv_transfer_config": PRODUCER},
            r"kv_role 'kv_producer' \(prefill\) disagrees with --disaggregation-mode decode",
        ),
        (
            {"disaggregation_transfer_backend": "mooncake", "kv_transfer_config": PRODUCER},
            "disagrees with --disaggregation-transfer-backend mooncake",
        ),
        ({"disaggregation_mode": "both"}, "--disaggregation-mode must be one of"),
        ({"disaggregation_bootstrap_port": 70000}, "--disaggregation-bootstrap-port"),
        ({"disaggregation_timeout": 0}, "--disaggregation-timeout must be > 0"),
        ({"kv_transfer_config": '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'}, "kv_both"),
    ],
)
def test_inconsistent_disaggregation_settings_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        EngineArgs.from_kwargs("m", **kwargs)
    assert "\n" not in str(info.value)


def test_a_contradiction_on_the_command_line_exits_with_one_line(capsys):
    ns = cli.build_parser().parse_args(
        ["--disaggregation-mode", "decode", "--kv-transfer-config", PRODUCER]
    )
    with pytest.raises(ValueError, match="disagrees") as info:
        cli.engine_args_from(ns)
    assert "\n" not in str(info.value)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--kv-transfer-config", "{not json"])
    assert "kv_transfer_config is not JSON" in capsys.readouterr().err


def test_the_worker_secret_is_accepted_for_the_bootstrap_port_without_workers(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret-s3cret-s3cret\n")
    ns = cli.build_parser().parse_args(
        ["--disaggregation-mode", "prefill", "--worker-secret-file", str(secret)]
    )
    cli.check_server_flags(ns)
    assert cli.placement(ns).secret == "s3cret-s3cret-s3cret"
    ns = cli.build_parser().parse_args(["--worker-secret-file", str(secret)])
    with pytest.raises(ValueError, match="needs --worker or --disaggregation-mode"):
        cli.check_server_flags(ns)


# -- the gateway's Generate on each kind of server ----------------------------------------


def _generate(n: int = 1, dp: bool = True, **sampling) -> sg.GenerateRequest:
    req = sg.GenerateRequest(
        request_id="g1",
        tokenized=sg.TokenizedInput(input_ids=[5, 6, 7]),
        # What the gateway sends for a plain request.
        sampling_params=sg.SamplingParams(
            max_new_tokens=16, n=n, top_p=1, top_k=-1, repetition_penalty=1, **sampling
        ),
    )
    if dp:
        req.disaggregated_params.bootstrap_host = "10.0.0.7"
        req.disaggregated_params.bootstrap_port = 8998
        req.disaggregated_params.bootstrap_room = 123456
    return req


def test_a_prefill_server_computes_the_first_token_and_a_decode_the_rest():
    p = gateway_request(_generate(min_new_tokens=4), 64, PREFILL)
    assert (p.params.max_tokens, p.params.min_tokens) == (1, 1)
    assert (p.kv_transfer.role, p.kv_transfer.room) == (PREFILL, 123456)
    d = gateway_request(_generate(min_new_tokens=4), 64, DECODE)
    assert (d.params.max_tokens, d.params.min_tokens) == (16, 4)
    kv = d.kv_transfer
    assert (kv.role, kv.room, kv.bootstrap_host, kv.bootstrap_port) == (
        DECODE,
        123456,
        "10.0.0.7",
        8998,
    )


def test_each_sample_is_a_transfer_of_its_own_with_the_same_room_on_both_sides():
    p = gateway_request(_generate(n=3), 64, PREFILL)
    d = gateway_request(_generate(n=3), 64, DECODE)
    p_rooms = [p.kv_transfer_of(i).room for i in range(3)]
    assert p_rooms == [d.kv_transfer_of(i).room for i in range(3)]
    assert p_rooms[0] == 123456 and len(set(p_rooms)) == 3
    # Rooms of distinct gateway rooms never collide (the gateway's are int32).
    other = _generate(n=3)
    other.disaggregated_params.bootstrap_room = -(2**31)
    rooms = {gateway_request(other, 64, DECODE).kv_transfer_of(i).room for i in range(3)}
    assert not rooms & set(p_rooms)


@pytest.mark.parametrize(
    "mode, request_, message",
    [
        (
            "null",
            _generate(),
            "disaggregated_params: this server is not part of a prefill/decode pair",
        ),
        (PREFILL, _generate(dp=False), "disaggregated_params: this server is the prefill half"),
        (DECODE, _generate(dp=False), "disaggregated_params: this server is the decode half"),
    ],
)
def test_requests_that_do_not_fit_the_servers_part_are_refused_naming_the_field(
    mode, request_, message
):
    with pytest.raises(ValueError, match=message):
        gateway_request(request_, 64, mode)


def test_a_null_server_serves_an_empty_disaggregated_params_as_before():
    req = _generate(dp=False)
    req.disaggregated_params.SetInParent()  # present, bootstrap_host empty
    assert gateway_request(req, 64).kv_transfer is None


def test_logprobs_and_a_bad_bootstrap_port_are_refused_on_a_pair():
    req = _generate()
    req.return_logprob = True
    with pytest.raises(ValueError, match="return_logprob"):
        gateway_request(req, 64, DECODE)
    req = _generate()
    req.disaggregated_params.bootstrap_port = 0
    with pytest.raises(ValueError, match="bootstrap_port must be in 1..65535"):
        gateway_request(req, 64, DECODE)


# -- start-up refusals (before the weights load) ------------------------------------------


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


def _refused_before_loading(args: EngineArgs) -> str:
    from tokenbudget.server.engine.factory import build_engine_core

    def loading():
        raise AssertionError("refused too late: the weights were about to load")

    with pytest.raises(ValueError) as info:
        build_engine_core(args, before_load=loading)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_sliding_window_model_is_refused_with_disaggregation(tmp_path):
    from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

    model = build_tiny_qwen3(
        tmp_path, use_sliding_window=True, sliding_window=32, max_window_layers=1
    )
    message = _refused_before_loading(EngineArgs(model=model, disaggregation_mode="prefill"))
    assert "--disaggregation-mode prefill with a sliding-window model is not supported" in message


def test_the_host_kv_tier_is_refused_with_disaggregation(tiny_qwen3):
    args = EngineArgs.from_kwargs(tiny_qwen3, disaggregation_mode="decode", num_offload_blocks=8)
    message = _refused_before_loading(args)
    assert "--disaggregation-mode decode with the host KV tier is not supported" in message


def test_a_taken_bootstrap_port_is_refused_before_loading(tiny_qwen3):
    import socket

    from tokenbudget.proto.rpc.ports import BindError
    from tokenbudget.server.engine.factory import build_engine_core

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = EngineArgs.from_kwargs(
            tiny_qwen3, disaggregation_mode="prefill", disaggregation_bootstrap_port=port
        )
        with pytest.raises(BindError, match=f"127.0.0.1:{port}"):
            build_engine_core(args, before_load=lambda: pytest.fail("refused too late"))

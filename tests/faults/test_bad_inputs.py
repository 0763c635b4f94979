"""Bad input against real `server` processes (issue 10): every kind gets a
clear status (or in-band error) naming the field, none crashes, hangs or
leaks a KV block, and the server serves normally afterwards.

One text server (the tiny Qwen3) and one vision-language server (the tiny
Qwen2.5-VL) start in parallel, once for the module. Each row of ``CASES``
is one kind of bad input: what is sent, the status expected and words the
message must hold (the field's name). A few rows are inputs that must be
served, not refused (max_tokens far past the context is clamped, a 1x1
image, a regex that backtracking engines take exponential time on).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from tokenbudget.proto import common_pb2, generate_pb2, generate_pb2_grpc
from tokenbudget.proto import sglang_scheduler_pb2 as sg
from tokenbudget.proto import sglang_scheduler_pb2_grpc as sg_grpc

MAX_MODEL_LEN = 128
MAX_LOGPROBS = 5
MAX_MESSAGE_SIZE = 1 << 20
TIMEOUT = 30.0  # per call: no bad input may hang the server
INVALID = grpc.StatusCode.INVALID_ARGUMENT


# -- the servers -----------------------------------------------------------------------


@dataclass
class _Server:
    proc: subprocess.Popen
    log: list[str] = field(default_factory=list)
    port: int = 0
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait(self, timeout: float = 240.0) -> None:
        if not self.ready.wait(timeout) or not self.port:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.log[-40:]))
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + timeout
            while (
                stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status
                != health_pb2.HealthCheckResponse.SERVING
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError("server never reported SERVING")
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _start(model: str, *flags: str) -> _Server:
    argv = [
        str(Path(sys.executable).parent / "server"),
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--torch-threads",
        "1",
        *flags,
    ]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false"),
    )
    server = _Server(proc)

    def pump() -> None:  # keep the pipe drained; note the port once it listens
        for line in proc.stdout:
            server.log.append(line)
            if " listening on " in line:
                server.port = int(line.rsplit(":", 1)[1])
                server.ready.set()
        server.ready.set()

    threading.Thread(target=pump, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def servers(tiny_qwen3_path, tmp_path_factory) -> dict[str, _Server]:
    from tokenbudget.server.testing.tiny_vl_models import build_tiny_qwen2_5_vl

    text = _start(
        tiny_qwen3_path,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--num-gpu-blocks",
        "64",
        "--max-num-batched-tokens",
        "64",
        "--max-logprobs",
        str(MAX_LOGPROBS),
        "--max-message-size",
        str(MAX_MESSAGE_SIZE),
    )
    vl_path = build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("bad_input_vl"), seed=0)
    vl = _start(vl_path, "--max-num-batched-tokens", "64", "--num-gpu-blocks", "64")
    try:
        text.wait()
        vl.wait()
    except Exception:
        text.stop()
        vl.stop()
        raise
    yield {"text": text, "vl": vl}
    text.stop()
    vl.stop()


@pytest.fixture(scope="module")
def channels(servers) -> dict[str, grpc.Channel]:
    options = [
        ("grpc.max_send_message_length", 8 << 20),
        ("grpc.max_receive_message_length", 8 << 20),
    ]
    opened = {
        name: grpc.insecure_channel(s.address, options=options) for name, s in servers.items()
    }
    yield opened
    for channel in opened.values():
        channel.close()


@pytest.fixture(scope="module")
def vocab_size(channels) -> int:
    stub = generate_pb2_grpc.GenerationStub(channels["text"])
    return stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=TIMEOUT).vocab_size


# -- what is sent --------------------------------------------------------------------------


def _png(width: int, height: int, mode: str = "RGB") -> bytes:
    """Mode "1" keeps a huge image cheap: 8000x8000 compresses to a few KB."""
    buf = io.BytesIO()
    Image.new(mode, (width, height)).save(buf, format="PNG")
    return buf.getvalue()


def _text(text: str = "Hello there", **params) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(text=text)
    for name, value in params.items():
        target = request.sampling_params
        if name == "structured":
            target.structured.CopyFrom(value)
        elif name == "logit_bias":
            target.logit_bias.update(value)
        elif name == "bad_words_token_ids":
            for ids in value:
                target.bad_words_token_ids.add(ids=ids)
        elif isinstance(value, list):
            getattr(target, name).extend(value)
        else:
            setattr(target, name, value)
    return request


def _tokens(ids: list[int]) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=ids))


def _chat(*parts: generate_pb2.ContentPart, role: str = "user") -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest()
    request.chat.messages.add(role=role, content=list(parts))
    return request


def _image_chat(image: bytes) -> generate_pb2.GenerateRequest:
    return _chat(
        generate_pb2.ContentPart(text="What is this?"), generate_pb2.ContentPart(image=image)
    )


def _deep_schema(levels: int) -> str:
    return (
        '{"type": "object", "properties": {"a": ' * levels
        + '{"type": "string"}'
        + '}, "required": ["a"]}' * levels
    )


def _sg_params(**fields) -> sg.SamplingParams:
    """The gateway's SamplingParams as the gateway sends them (every number set)."""
    return sg.SamplingParams(
        **{"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0, **fields}
    )


def _structured(**kind) -> common_pb2.StructuredOutput:
    return common_pb2.StructuredOutput(**kind)


@dataclass(frozen=True)
class Case:
    """One kind of bad input. ``send(V)`` builds what is sent (V: the vocabulary
    size); ``code`` and ``words`` what the answer must be; ``served`` checks
    the responses of an input that must be served instead."""

    name: str
    send: Callable[[int], object]
    code: grpc.StatusCode | None = INVALID
    words: str = ""
    server: str = "text"
    rpc: str = "Generate"  # Generate, Abort, GetStats, SglangGenerate, or "raw ..."
    served: Callable[[list], None] | None = None


def _clamped(responses: list) -> None:
    last = responses[-1]
    assert last.finish_reason == "length"
    assert last.usage.prompt_tokens + last.usage.completion_tokens == MAX_MODEL_LEN


def _only_as(responses: list) -> None:
    text = "".join(r.text for r in responses)
    assert re.fullmatch("a*", text), text
    assert responses[-1].finish_reason in ("length", "stop")


def _length(responses: list, n: int) -> None:
    assert responses[-1].finish_reason == "length" and responses[-1].usage.completion_tokens == n


SP = "sampling_params."
CASES = [
    # The prompt.
    Case("no input", lambda V: generate_pb2.GenerateRequest(), words="input: set one of"),
    Case("empty text", lambda V: _text(""), words="text: the prompt must not be empty"),
    Case("empty token ids", lambda V: _tokens([]), words="token_ids: the prompt must not be"),
    Case(
        "empty chat",
        lambda V: generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages()),
        words="chat.messages must not be empty",
    ),
    Case(
        "chat without a role",
        lambda V: _chat(generate_pb2.ContentPart(text="hi"), role=""),
        words="chat.messages[0].role",
    ),
    Case(
        "chat part unset",
        lambda V: _chat(generate_pb2.ContentPart()),
        words="chat.messages[0].content[0]: set text or image",
    ),
    Case(
        "text past max_prompt_bytes",
        lambda V: _text("a" * 300_000),
        words="more than max_prompt_bytes=",
    ),
    Case(
        "token ids past max_model_len",
        lambda V: _tokens([5] * (MAX_MODEL_LEN + 1)),
        words=f"token_ids: the prompt has {MAX_MODEL_LEN + 1} tokens",
    ),
    Case("negative token id", lambda V: _tokens([5, -1]), words="prompt_token_ids: token id -1"),
    Case(
        "token id past the vocabulary",
        lambda V: _tokens([5, V]),
        words="prompt_token_ids: token id",
    ),
    Case(
        "only special tokens",
        lambda V: _text("<|im_start|><|im_end|>", max_tokens=2, ignore_eos=True),
        code=None,
        served=lambda r: _length(r, 2),
    ),
    Case(
        "images to a text-only model",
        lambda V: generate_pb2.GenerateRequest(text="hi", images=[_png(8, 8)]),
        words="images: model",
    ),
    Case(
        "chat image to a text-only model", lambda V: _image_chat(_png(8, 8)), words="images: model"
    ),
    Case(
        "empty request id",
        lambda V: generate_pb2.GenerateRequest(request_id="", text="hi"),
        words="request_id must not be empty",
    ),
    # Every sampling field.
    Case("max_tokens 0", lambda V: _text(max_tokens=0), words=SP + "max_tokens must be >= 1"),
    Case(
        "max_tokens 10^9 is clamped",
        lambda V: _text(max_tokens=10**9, ignore_eos=True),
        code=None,
        served=_clamped,
    ),
    Case(
        "min_tokens > max_tokens",
        lambda V: _text(max_tokens=2, min_tokens=5),
        words=SP + "min_tokens must be <= max_tokens",
    ),
    Case("temperature -1", lambda V: _text(temperature=-1.0), words=SP + "temperature"),
    Case(
        "temperature inf",
        lambda V: _text(temperature=float("inf")),
        words=SP + "temperature must be a finite number",
    ),
    Case(
        "temperature nan",
        lambda V: _text(temperature=float("nan")),
        words=SP + "temperature must be a finite number",
    ),
    Case("top_p 0", lambda V: _text(top_p=0.0), words=SP + "top_p must be in (0, 1]"),
    Case("top_p 1.5", lambda V: _text(top_p=1.5), words=SP + "top_p must be in (0, 1]"),
    Case("top_k -2", lambda V: _text(top_k=-2), words=SP + "top_k must be >= -1"),
    Case("min_p 1.5", lambda V: _text(min_p=1.5), words=SP + "min_p must be in [0, 1]"),
    Case("seed -1", lambda V: _text(seed=-1), words=SP + "seed must be >= 0"),
    Case(
        "stop token past the vocabulary",
        lambda V: _text(stop_token_ids=[V]),
        words=SP + "stop_token_ids: token id",
    ),
    Case(
        "negative stop token",
        lambda V: _text(stop_token_ids=[-1]),
        words=SP + "stop_token_ids must be >= 0",
    ),
    Case(
        "logprobs past max_logprobs",
        lambda V: _text(logprobs=MAX_LOGPROBS + 1),
        words=SP + f"logprobs must be <= max_logprobs ({MAX_LOGPROBS}",
    ),
    Case(
        "logprobs past the vocabulary",
        lambda V: _text(logprobs=V + 1),
        words=SP + "logprobs must be <= the vocabulary size",
    ),
    Case("negative logprobs", lambda V: _text(logprobs=-1), words=SP + "logprobs must be >= 0"),
    Case(
        "prompt_logprobs past the vocabulary",
        lambda V: _text(prompt_logprobs=V + 1),
        words=SP + "prompt_logprobs must be <=",
    ),
    Case(
        "repetition_penalty 0",
        lambda V: _text(repetition_penalty=0.0),
        words=SP + "repetition_penalty must be in (0",
    ),
    Case(
        "frequency_penalty 3",
        lambda V: _text(frequency_penalty=3.0),
        words=SP + "frequency_penalty must be in [-2, 2]",
    ),
    Case(
        "presence_penalty -3",
        lambda V: _text(presence_penalty=-3.0),
        words=SP + "presence_penalty must be in [-2, 2]",
    ),
    Case(
        "logit_bias token past the vocabulary",
        lambda V: _text(logit_bias={V: 1.0}),
        words=SP + "logit_bias: token id",
    ),
    Case(
        "logit_bias 1000",
        lambda V: _text(logit_bias={3: 1000.0}),
        words=SP + "logit_bias[3] must be in [-100.0, 100.0]",
    ),
    Case(
        "allowed token past the vocabulary",
        lambda V: _text(allowed_token_ids=[3, V]),
        words=SP + "allowed_token_ids: token id",
    ),
    Case("empty bad word", lambda V: _text(bad_words=[""]), words=SP + "bad_words[0] must be"),
    Case(
        "empty bad word ids",
        lambda V: _text(bad_words_token_ids=[[]]),
        words=SP + "bad_words_token_ids[0] must not be empty",
    ),
    Case(
        "bad word id past the vocabulary",
        lambda V: _text(bad_words_token_ids=[[3, V]]),
        words=SP + "bad_words_token_ids[0]: token id",
    ),
    Case("n 0", lambda V: _text(n=0), words=SP + "n must be >= 1"),
    Case("n 1000", lambda V: _text(n=1000), words=SP + "n must be <= 128"),
    Case(
        "truncate_prompt_tokens 0",
        lambda V: _text(truncate_prompt_tokens=0),
        words=SP + "truncate_prompt_tokens must be >= 1",
    ),
    Case("empty stop string", lambda V: _text(stop=[""]), words=SP + "stop[0] must be"),
    # Structured output.
    Case(
        "structured with no kind",
        lambda V: _text(structured=_structured()),
        words=SP + "structured: set one of",
    ),
    Case(
        "json_schema not JSON",
        lambda V: _text(structured=_structured(json_schema="{nope")),
        words=SP + "structured.json_schema is not valid JSON",
    ),
    Case(
        "json_schema 200 levels deep",
        lambda V: _text(structured=_structured(json_schema=_deep_schema(200))),
        words=SP + "structured.json_schema: nested 401 levels deep, more than 64",
    ),
    Case(
        "regex that does not parse",
        lambda V: _text(structured=_structured(regex="(ab")),
        words=SP + "structured.regex",
    ),
    Case(
        "grammar that does not parse",
        lambda V: _text(structured=_structured(grammar="root ::= ")),
        words=SP + "structured.grammar",
    ),
    Case(
        "empty choice",
        lambda V: _text(structured=_structured(choice=common_pb2.ChoiceList())),
        words=SP + "structured.choice must be a non-empty list",
    ),
    Case(
        "stop token past the vocabulary with a grammar",
        lambda V: _text(stop_token_ids=[V], structured=_structured(regex="[ab]+")),
        words=SP + "stop_token_ids: token id",
    ),
    Case(
        "catastrophic-backtracking regex",
        lambda V: _text(max_tokens=8, structured=_structured(regex="(a+)+$")),
        code=None,
        served=_only_as,
    ),
    # The message itself.
    Case(
        "message past the receive limit",
        lambda V: _text("b" * (MAX_MESSAGE_SIZE + 1000)),
        code=grpc.StatusCode.RESOURCE_EXHAUSTED,
        words="larger than max",
    ),
    Case(
        "invalid UTF-8 in text",
        lambda V: b"\x12\x04ok\xc3\x28",
        rpc="raw Generate",
        words="text: not valid UTF-8",
    ),
    Case(
        "invalid UTF-8 in a chat message",
        lambda V: (
            _chat(generate_pb2.ContentPart(text="MARK"))
            .SerializeToString()
            .replace(b"MARK", b"\xff\xfe\xfd\xfc")
        ),
        rpc="raw Generate",
        words="chat.messages[0].content[0].text: not valid UTF-8",
    ),
    Case(
        "corrupt protobuf",
        lambda V: b"\x0a\xff\xff\xff\xff\x0f garbage",
        rpc="raw Generate",
        words="not a valid tokenbudget.v1.GenerateRequest message",
    ),
    Case(
        "corrupt protobuf to GetStats",
        lambda V: b"\xff",
        rpc="raw GetStats",
        words="not a valid tokenbudget.v1.GetStatsRequest message",
    ),
    Case(
        "abort of an unknown request id",
        lambda V: generate_pb2.AbortRequest(request_id="no-such-request"),
        rpc="Abort",
        code=grpc.StatusCode.NOT_FOUND,
        words="request_id 'no-such-request' is not a live request",
    ),
    # The SGLang gateway's protocol (in-band errors: a status makes the gateway retry).
    Case(
        "gateway: empty input ids",
        lambda V: sg.GenerateRequest(tokenized=sg.TokenizedInput(), sampling_params=_sg_params()),
        rpc="SglangGenerate",
        words="tokenized.input_ids: the prompt must not be empty",
    ),
    Case(
        "gateway: input ids past the context",
        lambda V: sg.GenerateRequest(
            tokenized=sg.TokenizedInput(input_ids=[5] * (MAX_MODEL_LEN + 1)),
            sampling_params=_sg_params(),
        ),
        rpc="SglangGenerate",
        words=f"tokenized.input_ids: the prompt has {MAX_MODEL_LEN + 1} tokens",
    ),
    Case(
        "gateway: images",
        lambda V: sg.GenerateRequest(
            tokenized=sg.TokenizedInput(input_ids=[5]),
            mm_inputs=sg.MultimodalInputs(image_data=[_png(8, 8)]),
            sampling_params=_sg_params(),
        ),
        rpc="SglangGenerate",
        words="mm_inputs: multimodal inputs are not supported",
    ),
    Case(
        "gateway: max_new_tokens 0",
        lambda V: sg.GenerateRequest(
            tokenized=sg.TokenizedInput(input_ids=[5]), sampling_params=_sg_params(max_new_tokens=0)
        ),
        rpc="SglangGenerate",
        words="sampling_params.max_new_tokens must be >= 1",
    ),
    Case(
        "gateway: stop token past the vocabulary",
        lambda V: sg.GenerateRequest(
            tokenized=sg.TokenizedInput(input_ids=[5]),
            sampling_params=_sg_params(stop_token_ids=[V]),
        ),
        rpc="SglangGenerate",
        words="stop_token_ids: token id",
    ),
    Case(
        "gateway: corrupt protobuf",
        lambda V: b"\x12\xff\xff",
        rpc="raw SglangGenerate",
        words="not a valid sglang.grpc.scheduler.GenerateRequest message",
    ),
    # Images (the vision-language server).
    Case(
        "not an image",
        lambda V: _image_chat(b"\x89PNG but not really"),
        server="vl",
        words="messages[0].content[1].image: cannot decode",
    ),
    Case(
        "8000x8000 image",
        lambda V: _image_chat(_png(8000, 8000, mode="1")),
        server="vl",
        words="messages[0].content[1].image: the image is 8000x8000 = 64000000 pixels, more "
        "than max_image_pixels=16777216",
    ),
    Case(
        "1x1 image",
        lambda V: _with_params(_image_chat(_png(1, 1)), max_tokens=2, ignore_eos=True),
        server="vl",
        code=None,
        served=lambda r: _length(r, 2),
    ),
    Case(
        "image without a placeholder",
        lambda V: generate_pb2.GenerateRequest(text="no placeholder here", images=[_png(8, 8)]),
        server="vl",
        words="prompt: 1 image(s) but the prompt has 0",
    ),
]


# Issue 26, items 5-12: client strings (request_id, tenant, cache_salt), constraints
# that leave no token, gateway logit_bias keys. Ids are 500 kB, not 1 MB: the text
# server's --max-message-size is 1 MiB.
BIG = "i" * 500_000
EOS = 2  # the tiny Qwen3's


def _with(request, **fields):
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def _sg_bias(key: str) -> sg.GenerateRequest:
    return sg.GenerateRequest(
        tokenized=sg.TokenizedInput(input_ids=[5]),
        sampling_params=_sg_params(max_new_tokens=2, logit_bias={key: 1.0}),
    )


def _ids_cases() -> list[Case]:
    long_id = "request_id is longer than max_id_bytes=256"
    unprintable = "request_id holds a character that is not printable"
    cases = [
        Case("request_id 500 kB", lambda V: _with(_text(), request_id=BIG), words=long_id),
        Case("request_id 257 bytes", lambda V: _with(_text(), request_id="r" * 257), words=long_id),
        Case(
            "request_id 258 UTF-8 bytes",
            lambda V: _with(_text(), request_id="é" * 129),
            words=long_id,
        ),
        Case(
            "request_id 256 bytes is served",
            lambda V: _with(_text(max_tokens=2, ignore_eos=True), request_id="r" * 256),
            code=None,
            served=lambda r: _length(r, 2),
        ),
        Case("tenant 500 kB", lambda V: _with(_text(), tenant=BIG), words="tenant is longer than"),
        Case(
            "tenant with a newline", lambda V: _with(_text(), tenant="a\nb"), words="tenant holds"
        ),
        Case(
            "cache_salt 500 kB",
            lambda V: _with(_text(), cache_salt=BIG),
            words="cache_salt is longer",
        ),
        Case(
            "embed request_id 500 kB",
            lambda V: generate_pb2.EmbedRequest(request_id=BIG, text="hi"),
            rpc="Embed",
            words=long_id,
        ),
        Case(
            "embed tenant with a tab",
            lambda V: generate_pb2.EmbedRequest(tenant="a\tb", text="hi"),
            rpc="Embed",
            words="tenant holds",
        ),
        Case(
            "abort of a 500 kB id",
            lambda V: generate_pb2.AbortRequest(request_id=BIG),
            rpc="Abort",
            code=grpc.StatusCode.NOT_FOUND,
            words="characters) is not a live request",
        ),
        Case(
            "abort of an id with a newline",
            lambda V: generate_pb2.AbortRequest(request_id="x\nINFO forged"),
            rpc="Abort",
            code=grpc.StatusCode.NOT_FOUND,
            words="'x\\nINFO forged' is not a live request",
        ),
        Case(
            "gateway: request_id 500 kB",
            lambda V: _with(_sg_bias("5"), request_id=BIG),
            rpc="SglangGenerate",
            words=long_id,
        ),
        Case(
            "gateway: request_id with a newline",
            lambda V: _with(_sg_bias("5"), request_id="a\nb"),
            rpc="SglangGenerate",
            words=unprintable,
        ),
    ]
    for name, control in (
        ("newline", "\n"),
        ("carriage return", "\r"),
        ("NUL", "\0"),
        ("escape", "\x1b"),
        ("line separator", "\u2028"),
    ):
        cases.append(
            Case(
                f"request_id with a {name}",
                lambda V, c=control: _with(_text(), request_id=f"id{c}INFO forged line"),
                words=unprintable,
            )
        )
    return cases


def _constraint_cases() -> list[Case]:
    no_token = "no token is allowed at this step"
    return [
        Case(
            "allowed_token_ids only EOS with min_tokens",
            lambda V: _text(allowed_token_ids=[EOS], min_tokens=4),
            words=SP + "allowed_token_ids: every allowed token is an EOS or stop token",
        ),
        Case(
            "allowed_token_ids only stop tokens with min_tokens",
            lambda V: _text(allowed_token_ids=[7, 8], stop_token_ids=[7, 8], min_tokens=2),
            words=SP + "allowed_token_ids: every allowed token is an EOS or stop token",
        ),
        Case(
            "allowed_token_ids all bad words",
            lambda V: _text(allowed_token_ids=[7, 8], bad_words_token_ids=[[7], [8]]),
            words=SP + "allowed_token_ids: every allowed token is banned by bad_words",
        ),
        Case(
            "choice that allowed_token_ids excludes",
            lambda V: _text(
                allowed_token_ids=[7],
                structured=_structured(choice=common_pb2.ChoiceList(choices=["yes", "no"])),
            ),
            words=no_token,
        ),
        Case(
            "bad words that ban every allowed token after one step",
            lambda V: _text(
                allowed_token_ids=[5, 7],
                bad_words_token_ids=[[5], [7, 7]],
                max_tokens=4,
                ignore_eos=True,
            ),
            words=no_token,
        ),
        Case(
            "random sampling with every allowed token banned mid-way",
            lambda V: _text(
                allowed_token_ids=[5, 7],
                bad_words_token_ids=[[5], [7, 7]],
                max_tokens=4,
                ignore_eos=True,
                temperature=1.0,
                seed=3,
            ),
            words=no_token,
        ),
    ]


def _gateway_bias_cases() -> list[Case]:
    words = "logit_bias key must be a token id"
    keys = {
        "superscript two": "\u00b2",
        "5000 digits": "9" * 5000,
        "negative": "-1",
        "letters": "abc",
        "Arabic-Indic digit": "\u0663",
        "spaces": " 12",
    }
    return [
        Case(
            f"gateway: logit_bias key {name}",
            lambda V, k=key: _sg_bias(k),
            rpc="SglangGenerate",
            words=words,
        )
        for name, key in keys.items()
    ]


CASES += _ids_cases() + _constraint_cases() + _gateway_bias_cases()


# Issue 26, items 1-3: the bounds on stop strings, bad words and structured specs
# (server/engine/request_limits.py, default flags), each refused naming its field
# before anything is tokenized, matched or compiled; at the bounds, served.
KB300 = 300_000


def _sg_text(**fields) -> sg.GenerateRequest:
    return sg.GenerateRequest(
        tokenized=sg.TokenizedInput(input_ids=[5]),
        sampling_params=_sg_params(max_new_tokens=2, **fields),
    )


def _gateway_completed(responses: list) -> None:
    kinds = [r.WhichOneof("response") for r in responses]
    assert "error" not in kinds and kinds[-1] == "complete", kinds


def _samples_finished(responses: list, n: int) -> None:
    assert [r.finish_reason for r in responses if r.finish_reason] == ["length"] * n


def _request_cost_cases() -> list[Case]:
    limit = "(the server's limit)"
    served = {"code": None, "served": lambda r: _length(r, 4)}
    short = {"max_tokens": 4, "ignore_eos": True}
    structured_bound = "is longer than max_structured_bytes=262144 bytes"
    return [
        Case(
            "1025 stop strings",
            lambda V: _text(stop=[f"s{i}" for i in range(1025)]),
            words=SP + f"stop: 1025 entries, more than max_stop_strings=1024 {limit}",
        ),
        Case(
            "100k stop strings",
            lambda V: _text(stop=[f"s{i}" for i in range(100_000)]),
            words=SP + "stop: 100000 entries, more than max_stop_strings=1024",
        ),
        Case(
            "stop string of 257 bytes",
            lambda V: _text(stop=["ok", "s" * 257]),
            words=SP + "stop[1] is longer than max_stop_string_bytes=256",
        ),
        Case(
            "stop string of 86 three-byte characters",
            lambda V: _text(stop=["\u6771" * 86]),
            words=SP + "stop[0] is longer than max_stop_string_bytes=256",
        ),
        Case(
            "stop string of 300 kB",
            lambda V: _text(stop=["s" * KB300]),
            words=SP + "stop[0] is longer than max_stop_string_bytes=256",
        ),
        Case(
            "1024 stop strings of 256 bytes are served",
            lambda V: _text(stop=[f"{i:04d}" + "z" * 252 for i in range(1024)], **short),
            **served,
        ),
        Case(
            "1025 bad words",
            lambda V: _text(bad_words=[f"w{i}" for i in range(1025)]),
            words=SP + f"bad_words: 1025 entries, more than max_bad_words=1024 {limit}",
        ),
        Case(
            "100k bad words",
            lambda V: _text(bad_words=[f"w{i}" for i in range(100_000)]),
            words=SP + "bad_words: 100000 entries, more than max_bad_words=1024",
        ),
        Case(
            "bad word of 257 bytes",
            lambda V: _text(bad_words=["w" * 257]),
            words=SP + "bad_words[0] is longer than max_bad_word_bytes=256",
        ),
        Case(
            "bad word of 300 kB",
            lambda V: _text(bad_words=["w" * KB300]),
            words=SP + "bad_words[0] is longer than max_bad_word_bytes=256",
        ),
        Case(
            "1025 bad word token id lists",
            lambda V: _text(bad_words_token_ids=[[5]] * 1025),
            words=SP + "bad_words_token_ids: 1025 entries, more than max_bad_words=1024",
        ),
        Case(
            "bad words and token id lists past the bound together",
            lambda V: _text(bad_words=["a"] * 600, bad_words_token_ids=[[5]] * 600),
            words=SP + "bad_words and bad_words_token_ids: 1200 entries",
        ),
        Case(
            "bad word token ids of 257 tokens",
            lambda V: _text(bad_words_token_ids=[[5] * 257]),
            words=SP + "bad_words_token_ids[0] has 257 tokens, more than max_bad_word_bytes=256",
        ),
        Case(
            "1024 bad words of 200 bytes are served",
            lambda V: _text(bad_words=[f"{i:04d}" + "b" * 196 for i in range(1024)], **short),
            **served,
        ),
        Case(
            "json_schema of 300 kB",
            lambda V: _text(
                structured=_structured(
                    json_schema='{"type": "string", "description": "' + "d" * KB300 + '"}'
                )
            ),
            words=SP + "structured.json_schema " + structured_bound,
        ),
        Case(
            "regex of 300 kB",
            lambda V: _text(structured=_structured(regex="a" * KB300)),
            words=SP + "structured.regex " + structured_bound,
        ),
        Case(
            "grammar of 300 kB",
            lambda V: _text(structured=_structured(grammar='root ::= "' + "a" * KB300 + '"')),
            words=SP + "structured.grammar " + structured_bound,
        ),
        Case(
            "choice of 100k entries",
            lambda V: _text(
                structured=_structured(
                    choice=common_pb2.ChoiceList(choices=[f"c{i}" for i in range(100_000)])
                )
            ),
            words=SP + "structured.choice " + structured_bound,
        ),
        Case(
            "choice of one 300 kB entry",
            lambda V: _text(
                structured=_structured(choice=common_pb2.ChoiceList(choices=["c" * KB300]))
            ),
            words=SP + "structured.choice " + structured_bound,
        ),
        Case(
            "stop string of 64 four-byte characters is served",
            lambda V: _text(stop=["\U0001f642" * 64], **short),
            **served,
        ),
        Case(
            "stop string of 65 four-byte characters",
            lambda V: _text(stop=["\U0001f642" * 65]),
            words=SP + "stop[0] is longer than max_stop_string_bytes=256",
        ),
        Case(
            "bad word of 86 three-byte characters",
            lambda V: _text(bad_words=["\u6771" * 86]),
            words=SP + "bad_words[0] is longer than max_bad_word_bytes=256",
        ),
        Case(
            "1024 bad word token id lists are served",
            lambda V: _text(bad_words_token_ids=[[5, 7 + i % 50] for i in range(1024)], **short),
            **served,
        ),
        Case(
            "json_schema of 300 kB in three-byte characters",
            lambda V: _text(
                structured=_structured(json_schema='{"description": "' + "\u6771" * 100_000 + '"}')
            ),
            words=SP + "structured.json_schema " + structured_bound,
        ),
        Case(
            "grammar of 300 kB in three-byte characters",
            lambda V: _text(
                structured=_structured(grammar='root ::= "' + "\u6771" * 100_000 + '"')
            ),
            words=SP + "structured.grammar " + structured_bound,
        ),
        Case(
            "choice of three 100 kB entries",
            lambda V: _text(
                structured=_structured(choice=common_pb2.ChoiceList(choices=["c" * 100_000] * 3))
            ),
            words=SP + "structured.choice " + structured_bound,
        ),
        Case(
            "gateway: 100k stop strings",
            lambda V: _sg_text(stop=[f"s{i}" for i in range(100_000)]),
            rpc="SglangGenerate",
            words="stop: 100000 entries, more than max_stop_strings=1024",
        ),
        Case(
            "gateway: stop string of 300 kB",
            lambda V: _sg_text(stop=["s" * KB300]),
            rpc="SglangGenerate",
            words="stop[0] is longer than max_stop_string_bytes=256",
        ),
        Case(
            "gateway: 1024 stop strings are served",
            lambda V: _sg_text(stop=[f"{i:04d}#" for i in range(1024)]),
            rpc="SglangGenerate",
            code=None,
            served=_gateway_completed,
        ),
        Case(
            "1024 copies of one stop string are served",
            lambda V: _text(stop=["zq#"] * 1024, **short),
            **served,
        ),
        Case(
            "stop strings that begin one another are served",
            lambda V: _text(stop=["z" * k for k in range(1, 257)], **short),
            **served,
        ),
        Case(
            "1024 stop strings kept in the output are served",
            lambda V: _text(
                stop=[f"{i:04d}#" for i in range(1024)], include_stop_str_in_output=True, **short
            ),
            **served,
        ),
        Case(
            "1024 stop strings for 4 samples are served",
            lambda V: _text(stop=[f"{i:04d}#" for i in range(1024)], n=4, **short),
            code=None,
            served=lambda r: _samples_finished(r, 4),
        ),
        Case(
            "1024 stop strings after min_tokens are served",
            lambda V: _text(stop=[f"{i:04d}#" for i in range(1024)], min_tokens=3, **short),
            **served,
        ),
        Case(
            "1024 stop strings and 1024 bad words together are served",
            lambda V: _text(
                stop=[f"{i:04d}#" for i in range(1024)],
                bad_words=[f"{i:04d}%" for i in range(1024)],
                **short,
            ),
            **served,
        ),
        Case(
            "bad word of 256 bytes is served",
            lambda V: _text(bad_words=["b" * 256], **short),
            **served,
        ),
        Case(
            "bad word of only spaces is served",
            lambda V: _text(bad_words=["   "], **short),
            **served,
        ),
        Case(
            "bad word token ids of 256 tokens are served",
            lambda V: _text(bad_words_token_ids=[[5] * 256], **short),
            **served,
        ),
        Case(
            "regex of 300 kB in three-byte characters",
            lambda V: _text(structured=_structured(regex="\u6771" * 100_000)),
            words=SP + "structured.regex " + structured_bound,
        ),
        Case(
            "choice of 100k empty strings",
            lambda V: _text(
                structured=_structured(choice=common_pb2.ChoiceList(choices=[""] * 100_000))
            ),
            words=SP + "structured.choice",
        ),
        Case(
            "gateway: json_schema of 300 kB in three-byte characters",
            lambda V: _sg_text(json_schema='{"description": "' + "\u6771" * 100_000 + '"}'),
            rpc="SglangGenerate",
            words="structured.json_schema " + structured_bound,
        ),
        Case(
            "gateway: regex of 300 kB in three-byte characters",
            lambda V: _sg_text(regex="\u6771" * 100_000),
            rpc="SglangGenerate",
            words="structured.regex " + structured_bound,
        ),
        Case(
            "gateway: 1024 stop strings of 256 bytes are served",
            lambda V: _sg_text(stop=[f"{i:04d}" + "z" * 252 for i in range(1024)]),
            rpc="SglangGenerate",
            code=None,
            served=_gateway_completed,
        ),
        Case(
            "json_schema one byte past the bound",
            lambda V: _text(
                structured=_structured(
                    json_schema='{"description": "'
                    + "d" * (262144 - len('{"description": ""}') + 1)
                    + '"}'
                )
            ),
            words=SP + "structured.json_schema " + structured_bound,
        ),
        Case(
            "stop string of 128 two-byte characters is served",
            lambda V: _text(stop=["\u00e9" * 128], **short),
            **served,
        ),
        Case(
            "bad word of 129 two-byte characters",
            lambda V: _text(bad_words=["\u00e9" * 129]),
            words=SP + "bad_words[0] is longer than max_bad_word_bytes=256",
        ),
        Case(
            "1024 bad word token id lists of 256 tokens are served",
            lambda V: _text(
                bad_words_token_ids=[[5] * 255 + [7 + i % 50] for i in range(1024)], **short
            ),
            **served,
        ),
        Case(
            "1024 bad words with leading spaces are served",
            lambda V: _text(bad_words=[f"   w{i}" for i in range(1024)], **short),
            **served,
        ),
        Case(
            "gateway: stop string of 129 two-byte characters",
            lambda V: _sg_text(stop=["\u00e9" * 129]),
            rpc="SglangGenerate",
            words="stop[0] is longer than max_stop_string_bytes=256",
        ),
        Case(
            "gateway: 1025 stop strings",
            lambda V: _sg_text(stop=[f"s{i}" for i in range(1025)]),
            rpc="SglangGenerate",
            words="stop: 1025 entries, more than max_stop_strings=1024",
        ),
        Case(
            "gateway: stop string of 257 bytes",
            lambda V: _sg_text(stop=["s" * 257]),
            rpc="SglangGenerate",
            words="stop[0] is longer than max_stop_string_bytes=256",
        ),
        Case(
            "gateway: json_schema of 300 kB",
            lambda V: _sg_text(json_schema='{"description": "' + "d" * KB300 + '"}'),
            rpc="SglangGenerate",
            words="structured.json_schema " + structured_bound,
        ),
        Case(
            "gateway: regex of 300 kB",
            lambda V: _sg_text(regex="a" * KB300),
            rpc="SglangGenerate",
            words="structured.regex " + structured_bound,
        ),
        Case(
            "gateway: ebnf_grammar of 300 kB",
            lambda V: _sg_text(ebnf_grammar='root ::= "' + "a" * KB300 + '"'),
            rpc="SglangGenerate",
            words=structured_bound,
        ),
    ]


CASES += _request_cost_cases()


def _with_params(request: generate_pb2.GenerateRequest, **params) -> generate_pb2.GenerateRequest:
    for name, value in params.items():
        setattr(request.sampling_params, name, value)
    return request


def _call(channel: grpc.Channel, case: Case, message) -> tuple[grpc.StatusCode, str, list]:
    """(status code, details or in-band error message, responses)."""

    def identity(b: bytes) -> bytes:
        return b

    if case.rpc.startswith("raw "):
        method = case.rpc[4:]
        path = (
            "/sglang.grpc.scheduler.SglangScheduler/Generate"
            if method == "SglangGenerate"
            else f"/tokenbudget.v1.Generation/{method}"
        )
        streaming = method.endswith("Generate")
        call = (channel.unary_stream if streaming else channel.unary_unary)(
            path, request_serializer=identity, response_deserializer=identity
        )
    elif case.rpc == "SglangGenerate":
        call = sg_grpc.SglangSchedulerStub(channel).Generate
        streaming = True
    else:
        call = getattr(generate_pb2_grpc.GenerationStub(channel), case.rpc)
        streaming = case.rpc == "Generate"
    try:
        responses = (
            list(call(message, timeout=TIMEOUT)) if streaming else [call(message, timeout=TIMEOUT)]
        )
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", []
    errors = [
        r.error.message
        for r in responses
        if case.rpc == "SglangGenerate" and r.WhichOneof("response") == "error"
    ]
    return grpc.StatusCode.OK, errors[0] if errors else "", responses


# Internal details a client must never see.
_LEAKS = re.compile(r"Traceback|File \"|\.py\b|/site-packages/|Unexpected <class|Exception ")


def test_every_bad_input_is_answered_with_a_status_naming_the_field(channels, vocab_size):
    answered, wrong = 0, []
    for case in CASES:
        start = time.monotonic()
        code, message, responses = _call(channels[case.server], case, case.send(vocab_size))
        took = time.monotonic() - start
        if case.served is not None:
            ok, why = code == grpc.StatusCode.OK, f"not served: {code} {message!r}"
            if ok:
                case.served(responses)  # asserts what was served
        elif case.rpc == "SglangGenerate":
            ok = code == grpc.StatusCode.OK and case.words in message
            why = f"gateway answer {code} {message!r}"
        else:
            ok = code == case.code and case.words in message
            why = f"got {code.name} {message!r}"
        if _LEAKS.search(message):
            ok, why = False, f"internal details in {message!r}"
        if len(message) > 1000:  # client strings are quoted, not echoed whole
            ok, why = False, f"a {len(message)}-character message: {message[:200]!r}..."
        if "sampling_params.sampling_params" in message:
            ok, why = False, f"the field named twice in {message!r}"
        if took > 10:
            ok, why = False, f"took {took:.1f} s"
        if ok:
            answered += 1
        else:
            wrong.append(f"{case.name}: {why}")
    print(f"\nbad inputs tried: {len(CASES)}, answered as specified: {answered}")
    assert not wrong, "\n".join(wrong)
    assert len(CASES) >= 25


def test_the_servers_still_serve_with_nothing_left_running(channels, vocab_size):
    """Runs after the bad inputs: a normal request succeeds on each server, and
    no request, queue entry or KV block is left behind."""
    for name, channel in channels.items():
        stub = generate_pb2_grpc.GenerationStub(channel)
        request = _text("A normal request", max_tokens=4, ignore_eos=True, temperature=0.0)
        responses = list(stub.Generate(request, timeout=TIMEOUT))
        assert responses[-1].finish_reason == "length"
        assert sum(len(r.token_ids) for r in responses) == 4
        deadline = time.monotonic() + 10
        while True:
            stats = stub.GetStats(generate_pb2.GetStatsRequest(), timeout=TIMEOUT)
            idle = (stats.num_running, stats.num_waiting, stats.num_requests) == (
                0,
                0,
                0,
            ) and stats.num_free_blocks == stats.num_total_blocks
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert stats.healthy, name
        assert (stats.num_running, stats.num_waiting, stats.num_requests) == (0, 0, 0), name
        assert stats.num_free_blocks == stats.num_total_blocks, (name, stats)
        assert stats.kv_cache_usage == 0.0, (name, stats)

"""What hostile inputs cost the server process: time and memory of refusing
a 13000x13000 PNG and an 8 MB text prompt, and the resident memory after
many refused 2 MB prompts (issue 10, defects 9 and 10). Prints JSON.

    python benchmarks/input_limits.py [--model DIR] [--vl-model DIR] [--refusals 40]

Without model folders it builds the tiny test models in a temporary folder.
It also runs on a tree from before the limits (for the comparison).
Each measurement runs in a fresh child process, so peak memory is its own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

_CHILD = r"""
import io, json, resource, sys, time
mode, path, arg = sys.argv[1], sys.argv[2], int(sys.argv[3])

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) // 1024 for l in f if l.startswith("VmRSS"))

def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024

if mode in ("image", "prompt"):
    from tokenbudget.server.engine.input_processor import InputProcessor
    try:
        processor = InputProcessor.from_pretrained(path, max_model_len=8192)
    except TypeError:  # a tree from before the limits, for comparison
        processor = InputProcessor.from_pretrained(path)
    if mode == "image":
        from PIL import Image
        buf = io.BytesIO()
        Image.new("1", (13000, 13000)).save(buf, format="PNG")
        parts = [{"type": "text", "text": "look"}, {"type": "image", "image": buf.getvalue()}]
        prompt = {"messages": [{"role": "user", "content": parts}]}
        processor.mm_processor  # loaded before measuring
    else:
        prompt = "word " * (arg // 5)
    before, start = peak_mb(), time.perf_counter()
    try:
        processor.process(prompt)
        outcome = "accepted"
    except ValueError as exc:
        outcome = str(exc)[:160]
    print(json.dumps({"seconds": round(time.perf_counter() - start, 3),
                      "peak_growth_mb": peak_mb() - before, "outcome": outcome}))
else:  # refusals: N refused 2 MB prompts through a grpc.aio server in this process
    import asyncio, grpc, torch
    torch.set_num_threads(1)
    from tokenbudget.core.config import CacheConfig, SchedulerConfig
    from tokenbudget.server.engine.core import EngineCore
    from tokenbudget.core.utils.gc_policy import configure_gc
    from tokenbudget.proto import generate_pb2
    from tokenbudget.server.engine.async_engine import AsyncEngine
    from tokenbudget.server.entrypoints.grpc.generation import add_generation_servicer
    from tokenbudget.server.engine.input_processor import InputProcessor
    from tokenbudget.server.executor.inprocess import InProcessExecutor
    from tokenbudget.worker.worker import Worker
    core = EngineCore(SchedulerConfig(max_model_len=256), CacheConfig(num_blocks=64),
                      InProcessExecutor(Worker(path), async_mode=True))
    engine = AsyncEngine(core, InputProcessor.from_pretrained(path), model_name="m")

    async def main():
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        add_generation_servicer(server, engine)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        configure_gc()  # as the server does after start-up
        rss = [rss_mb()]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
                ("grpc.max_send_message_length", 64 << 20)]) as channel:
            call = channel.unary_stream(
                "/tokenbudget.v1.Generation/Generate",
                request_serializer=generate_pb2.GenerateRequest.SerializeToString,
                response_deserializer=generate_pb2.GenerateResponse.FromString)
            for i in range(arg):
                request = generate_pb2.GenerateRequest(text=f"{i} " + "x" * (2 << 20))
                request.sampling_params.temperature = -1  # refused, payload in hand
                try:
                    async for _ in call(request):
                        pass
                except grpc.aio.AioRpcError:
                    pass
                if (i + 1) % 10 == 0:
                    rss.append(rss_mb())
        await server.stop(0)
        return rss

    rss = asyncio.run(main())
    print(json.dumps({"rss_mb_every_10": rss}))
    engine.shutdown()
"""


def _child(mode: str, path: str, arg: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, path, str(arg)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a text model folder (default: tiny Qwen3)")
    p.add_argument("--vl-model", default=None, help="a Qwen2.5-VL folder (default: tiny)")
    p.add_argument("--refusals", type=int, default=40)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, vl_model = args.model, args.vl_model
        if model is None:
            from tokenbudget.server.testing.tiny_models import build_tiny_qwen3

            model = build_tiny_qwen3(f"{tmp}/text", seed=0)
        if vl_model is None:
            from tokenbudget.server.testing.tiny_vl_models import build_tiny_qwen2_5_vl

            vl_model = build_tiny_qwen2_5_vl(f"{tmp}/vl", seed=0)
        print(
            json.dumps(
                {
                    "png_13000x13000": _child("image", vl_model, 0),
                    "text_prompt_8mb": _child("prompt", model, 8 << 20),
                    f"refused_2mb_prompts_{args.refusals}": _child(
                        "refusals", model, args.refusals
                    ),
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()

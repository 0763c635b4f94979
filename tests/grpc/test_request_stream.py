"""RequestStream read from a thread and from an asyncio event loop (the
server's grpc.aio streams): every token once, in order, backlogs coalesced."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from tokenbudget.core import Request, RequestOutput, SamplingParams
from tokenbudget.server.engine.streams import RequestStream, wake_async_readers


def _stream() -> RequestStream:
    return RequestStream(Request("r", [1, 2, 3], SamplingParams(max_tokens=1000)))


def _outputs(n: int) -> list[RequestOutput]:
    return [RequestOutput("r", [i], "length" if i == n - 1 else None) for i in range(n)]


async def _read_async(stream: RequestStream) -> list:
    return [chunk async for chunk in stream]


def test_async_reader_gets_every_token_once_in_order_from_an_engine_thread():
    n = 300
    stream = _stream()
    rng = random.Random(0)

    def engine() -> None:
        # Like AsyncEngine._dispatch: queue without waking, then one wake per
        # step; now and then a single put that wakes by itself.
        for out in _outputs(n):
            if rng.random() < 0.2:
                stream.put(out)
            else:
                stream.put(out, wake=False)
                wake_async_readers([stream])
            if rng.random() < 0.3:
                time.sleep(rng.random() * 1e-3)

    async def main() -> list:
        reader = asyncio.ensure_future(_read_async(stream))
        while stream.loop is None:  # the reader registered its loop
            await asyncio.sleep(0)
        threading.Thread(target=engine).start()
        # A lost wake-up would hang here.
        return await asyncio.wait_for(reader, timeout=30)

    chunks = asyncio.run(main())
    assert [t for c in chunks for t in c.token_ids] == list(range(n))
    assert [c.finish_reason for c in chunks].count("length") == 1
    assert chunks[-1].finish_reason == "length"


def test_sync_and_async_readers_coalesce_a_backlog_into_one_chunk():
    def backlogged() -> RequestStream:
        stream = _stream()
        for out in _outputs(5):
            stream.put(out)  # queued before anyone reads
        return stream

    sync_chunks = list(backlogged())
    async_chunks = asyncio.run(_read_async(backlogged()))
    assert (
        [(c.token_ids, c.finish_reason) for c in sync_chunks]
        == [(c.token_ids, c.finish_reason) for c in async_chunks]
        == [([0, 1, 2, 3, 4], "length")]
    )


def test_async_reader_raises_the_engine_error():
    stream = _stream()
    stream.put(RequestOutput("r", [7]))
    stream.put(ValueError("grammar failed to compile"))
    with pytest.raises(ValueError, match="grammar failed to compile"):
        asyncio.run(_read_async(stream))

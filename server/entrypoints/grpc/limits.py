"""--max-concurrent-rpcs: a limit on generations in flight, not on every call.

gRPC's own ``maximum_concurrent_rpcs`` counts every call, so a busy server
refused health checks, GetStats and GetModelInfo too, and an orchestrator
would kill a healthy server for being busy. Here only the generation methods
count (Generate, and Embed, which also runs the model); beyond the limit
they get RESOURCE_EXHAUSTED at once, and everything else is always answered.

Refused requests are counted in bytes too (``refused_bytes``): a collection
runs once they add up, so a cycle holding a large refused payload does not
wait for thousands of other allocations (core/utils/gc_policy.py).
"""

from __future__ import annotations

import gc
import inspect
import threading

import grpc

from tokenbudget.server.entrypoints.grpc.errors import refuse
from tokenbudget.proto.rpc.auth import handler_with_behavior

REFUSED_BYTES_PER_COLLECTION = 256 << 20


class GenerationLimitInterceptor(grpc.aio.ServerInterceptor):
    """At most ``limit`` calls of ``methods`` (full names, "/pkg.Service/Method")
    in flight. Counted on the server's event loop, so no lock is needed."""

    def __init__(self, limit: int, methods: tuple[str, ...]) -> None:
        if limit < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {limit}")
        self.limit = limit
        self.active = 0
        self._methods = frozenset(methods)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self._methods:
            return handler
        behavior = handler.unary_stream or handler.unary_unary
        if inspect.isasyncgenfunction(behavior):

            async def limited(request, context):
                if not self._enter(context):
                    return
                try:
                    async for message in behavior(request, context):
                        yield message
                finally:
                    self.active -= 1
        else:

            async def limited(request, context):
                if not self._enter(context):
                    return None
                try:
                    return await behavior(request, context)
                finally:
                    self.active -= 1

        return handler_with_behavior(handler, limited)

    def _enter(self, context: grpc.aio.ServicerContext) -> bool:
        """Count the call in, or refuse it (False): a status and a return, not
        abort, whose exception would keep the request in a reference cycle
        (server/entrypoints/grpc/errors.py)."""
        if self.active >= self.limit:
            refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server is generating for {self.active} calls, its "
                f"--max-concurrent-rpcs={self.limit}; retry later",
            )
            return False
        self.active += 1
        return True


class RefusedBytes:
    """Counts the bytes of refused requests; ``add`` collects garbage each
    time they pass ``per_collection`` (from any thread)."""

    def __init__(self, per_collection: int = REFUSED_BYTES_PER_COLLECTION) -> None:
        if per_collection < 1:
            raise ValueError(f"per_collection must be >= 1, got {per_collection}")
        self.per_collection = per_collection
        self.collections = 0
        self._pending = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._pending += nbytes
            if self._pending < self.per_collection:
                return
            self._pending = 0
            self.collections += 1
        gc.collect()


# One per process, as the collector is: every service's refusals count together.
refused_bytes = RefusedBytes()

"""The Generation service's LoRA RPCs (LoadLoRAAdapter, UnloadLoRAAdapter)
and the adapter a GenerateRequest names, over the engine's LoRARegistry
(server/engine/lora_registry.py). A mixin of the Generation servicers."""

from __future__ import annotations

import grpc

from tokenbudget.core.lora import LoRARequest
from tokenbudget.proto import generate_pb2
from tokenbudget.server.entrypoints.grpc.errors import public_message, refuse

_NOT_ENABLED = "LoRA is not enabled on this server (start it with --enable-lora)"


def lora_request_of(engine, name: str, field: str = "lora_name") -> LoRARequest:
    """The adapter a request names (``field``: where); ValueError (INVALID_ARGUMENT)."""
    if engine.loras is None:
        raise ValueError(f"{field}: {_NOT_ENABLED}")
    try:
        return engine.loras.resolve(name)
    except ValueError as exc:
        raise ValueError(str(exc).replace("lora_name:", f"{field}:", 1)) from None


class LoRARPCs:
    engine: object  # the AsyncEngine; its ``loras`` is None without LoRA

    def _lora_request(self, name: str) -> LoRARequest:
        return lora_request_of(self.engine, name)

    def _lora_adapters(self) -> list[generate_pb2.LoRAAdapter]:
        loras = self.engine.loras
        return [
            generate_pb2.LoRAAdapter(name=a.lora_name, id=a.lora_int_id)
            for a in (loras.adapters() if loras is not None else ())
        ]

    def LoadLoRAAdapter(self, request: generate_pb2.LoadLoRAAdapterRequest, context):
        if self.engine.loras is None:
            refuse(context, grpc.StatusCode.FAILED_PRECONDITION, _NOT_ENABLED)
            return generate_pb2.LoadLoRAAdapterResponse()
        try:
            lora = self.engine.loras.load(request.lora_name, request.lora_path)
        except ValueError as exc:
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, public_message(exc))
            return generate_pb2.LoadLoRAAdapterResponse()
        return generate_pb2.LoadLoRAAdapterResponse(lora_int_id=lora.lora_int_id)

    def UnloadLoRAAdapter(self, request: generate_pb2.UnloadLoRAAdapterRequest, context):
        if self.engine.loras is None:
            refuse(context, grpc.StatusCode.FAILED_PRECONDITION, _NOT_ENABLED)
            return generate_pb2.UnloadLoRAAdapterResponse()
        try:
            self.engine.loras.unload(request.lora_name)
        except KeyError:
            refuse(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"LoRA adapter {request.lora_name!r} is not loaded",
            )
        return generate_pb2.UnloadLoRAAdapterResponse()


class AioLoRARPCs(LoRARPCs):
    """For a grpc.aio server (loading reads one small JSON file: on the loop)."""

    async def LoadLoRAAdapter(self, request, context):
        return LoRARPCs.LoadLoRAAdapter(self, request, context)

    async def UnloadLoRAAdapter(self, request, context):
        return LoRARPCs.UnloadLoRAAdapter(self, request, context)

"""tokenbudget.server: the engine front (offline LLM, gRPC services, CLI, client)."""
from tokenbudget.server.llm import LLM, GenerationResult

__all__ = ["GenerationResult", "LLM"]
from tokenbudget.server.async_engine import AsyncEngine  # noqa: E402
from tokenbudget.server.client import Client  # noqa: E402
from tokenbudget.server.grpc_service import add_generation_servicer  # noqa: E402

__all__ += ["AsyncEngine", "Client", "add_generation_servicer"]

"""tokenbudget.server: the engine front (offline LLM, gRPC services, CLI, client)."""
from tokenbudget.server.llm import LLM, GenerationResult

__all__ = ["GenerationResult", "LLM"]

"""Pooling requests in the model runner: their prompt's hidden states, pooled
across prefill chunks into one vector.

A pooling request samples nothing. Each step computes a chunk of its prompt;
the pooler reads the decoder's final hidden states (after the last norm, what
``AutoModel`` returns as ``last_hidden_state``) at that chunk's rows:

* MEAN adds the chunk's rows to a float32 running sum, divided by the prompt
  length when the last chunk is in;
* CLS keeps position 0's row from the chunk that starts at 0;
* LAST takes the last prompt token's row from the final chunk.

A chunk starting at position 0 resets the request's sums: a preempted request
recomputes its prompt from the start (MEAN and CLS requests never read the
prefix cache, so they always start at 0; LAST needs no history).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenbudget.core.pooling_params import PoolingParams


@dataclass(slots=True)
class _PoolingState:
    params: PoolingParams
    num_prompt_tokens: int
    total: torch.Tensor | None = None  # MEAN: float32 sum of the rows so far
    first: torch.Tensor | None = None  # CLS: position 0's row


class Pooler:
    """Per-request pooling state, and the hook that captures hidden states in
    the steps that need them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.states: dict[str, _PoolingState] = {}
        self._hidden: torch.Tensor | None = None
        self._capturing = False
        # The decoder's output is the CausalLM's input to lm_head; hooking it
        # leaves the forward untouched (logits_to_keep still trims lm_head).
        model.get_decoder().register_forward_hook(self._capture)

    def _capture(self, module, args, output) -> None:
        if self._capturing:
            self._hidden = (
                output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            )

    # -- requests -------------------------------------------------------------------
    def add(self, req_id: str, params: PoolingParams, num_prompt_tokens: int) -> None:
        self.states[req_id] = _PoolingState(params, num_prompt_tokens)

    def remove(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    def snapshot(self, req_ids: list[str]) -> list[tuple[_PoolingState, tuple]]:
        """What ``pool`` may change for ``req_ids``, to ``restore`` when the
        step is run again (worker/fault_isolation.py); sums are replaced,
        never updated in place, so references suffice."""
        if not self.states:
            return []
        return [(s, (s.total, s.first)) for s in map(self.states.get, req_ids) if s is not None]

    @staticmethod
    def restore(snapshot: list[tuple[_PoolingState, tuple]]) -> None:
        for state, (total, first) in snapshot:
            state.total, state.first = total, first

    def mask(self, req_ids: list[str]) -> np.ndarray | None:
        """[B] bool: which of the step's requests pool (None when none does)."""
        if not self.states:
            return None
        mask = np.fromiter((r in self.states for r in req_ids), bool, len(req_ids))
        return mask if mask.any() else None

    # -- one step -------------------------------------------------------------------
    def start_step(self, pooling: np.ndarray | None) -> None:
        """Capture this step's hidden states if any request in it pools."""
        self._capturing = pooling is not None
        self._hidden = None

    def pool(
        self,
        req_ids: list[str],
        starts: np.ndarray,
        query_lens: np.ndarray,
        pooling: np.ndarray | None,
    ) -> list[torch.Tensor | None] | None:
        """Fold this step's chunks in; returns, per request of the step, the
        pooled vector (float32, on the CPU) of each pooling request whose
        prompt completed, else None. None when no request pooled."""
        self._capturing = False
        if pooling is None:
            return None
        hidden, self._hidden = self._hidden, None
        if hidden is None:
            raise RuntimeError("the decoder's hidden states were not captured this step")
        hidden = hidden.reshape(-1, hidden.shape[-1])
        first_rows = np.cumsum(query_lens) - query_lens
        out: list[torch.Tensor | None] = [None] * len(req_ids)
        done: list[int] = []
        vectors: list[torch.Tensor] = []
        for i in np.flatnonzero(pooling):
            state = self.states[req_ids[i]]
            start, n, row = int(starts[i]), int(query_lens[i]), int(first_rows[i])
            kind = state.params.pooling_type
            if start == 0:
                state.total = state.first = None
            if kind == "MEAN":
                chunk = hidden[row : row + n].float().sum(0)
                state.total = chunk if state.total is None else state.total + chunk
            elif kind == "CLS" and start == 0:
                state.first = hidden[row].float()
            if start + n < state.num_prompt_tokens:
                continue
            if kind == "MEAN":
                vec = state.total / state.num_prompt_tokens
            elif kind == "CLS":
                vec = state.first
            else:
                vec = hidden[row + n - 1].float()
            if vec is None:
                raise RuntimeError(f"request {req_ids[i]}: CLS pooling never saw position 0")
            if state.params.normalize:
                vec = torch.nn.functional.normalize(vec, p=2, dim=-1)
            done.append(int(i))
            vectors.append(vec)
        if vectors:
            # One device-to-host copy for every vector of the step.
            for i, vec in zip(done, torch.stack(vectors).cpu().unbind(0)):
                out[i] = vec
        return out

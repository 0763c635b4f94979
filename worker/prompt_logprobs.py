"""Prompt logprobs: which packed rows of a step predict which prompt tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenbudget.core.outputs import PromptLogprobs

if TYPE_CHECKING:
    from tokenbudget.worker.input_batch import RequestState, StepInputs


class PromptRows:
    """Requests that want prompt logprobs in this step: their packed rows and
    the prompt tokens those rows predict."""

    def __init__(self) -> None:
        self.req_ids: list[str] = []
        self.starts: list[int] = []
        self.num_top: list[int] = []
        self._packed: list[np.ndarray] = []
        self._targets: list[np.ndarray] = []

    def add(
        self, req_id: str, start: int, num_top: int, packed: np.ndarray, targets: np.ndarray
    ) -> None:
        self.req_ids.append(req_id)
        self.starts.append(start)
        self.num_top.append(num_top)
        self._packed.append(packed)
        self._targets.append(targets)

    @property
    def packed(self) -> np.ndarray:
        return np.concatenate(self._packed)

    def logprobs(self, logits: torch.Tensor) -> dict[str, PromptLogprobs]:
        """``logits``: the rows of ``packed``, in order."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.from_numpy(np.concatenate(self._targets)).to(lp.device)
        ids = targets.unsqueeze(1)
        max_top = max(self.num_top)
        if max_top:
            ids = torch.cat([ids, lp.topk(max_top, dim=-1).indices], dim=1)
        ids_l, values_l = ids.tolist(), lp.gather(1, ids).tolist()
        out, row = {}, 0
        for rid, start, n, packed in zip(self.req_ids, self.starts, self.num_top, self._packed):
            entries = [
                dict(zip(ids_l[r][: n + 1], values_l[r][: n + 1]))
                for r in range(row, row + len(packed))
            ]
            out[rid] = PromptLogprobs(start, entries)
            row += len(packed)
        return out


def prompt_logprob_rows(
    step: StepInputs, requests: dict[str, RequestState], token_ids: np.ndarray
) -> PromptRows | None:
    """The packed rows whose logits give this step's prompt logprobs: the
    logits at prompt position j predict prompt token j + 1 (``token_ids``:
    the batch's rows of token ids)."""
    rows = None
    first_rows = None
    for i, rid in enumerate(step.req_ids):
        state = requests[rid]
        num_top = state.sampling_params.prompt_logprobs
        if num_top is None:
            continue
        start = int(step.starts[i])
        end = min(start + int(step.query_lens[i]), state.num_prompt_tokens - 1)
        if start >= end:
            continue
        if rows is None:
            rows = PromptRows()
            first_rows = np.cumsum(step.query_lens) - step.query_lens
        first = int(first_rows[i])
        rows.add(
            rid,
            start + 1,
            num_top,
            np.arange(first, first + end - start),
            token_ids[step.rows[i], start + 1 : end + 1],
        )
    return rows

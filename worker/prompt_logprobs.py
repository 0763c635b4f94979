"""Prompt logprobs: which packed rows of a step predict which prompt tokens."""
from __future__ import annotations

import numpy as np
import torch

from tokenbudget.core.outputs import PromptLogprobs


class PromptRows:
    """Requests that want prompt logprobs in this step: their packed rows and
    the prompt tokens those rows predict."""

    def __init__(self) -> None:
        self.req_ids: list[str] = []
        self.starts: list[int] = []
        self.num_top: list[int] = []
        self._packed: list[np.ndarray] = []
        self._targets: list[np.ndarray] = []

    def add(self, req_id: str, start: int, num_top: int, packed: np.ndarray,
            targets: np.ndarray) -> None:
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
            entries = [dict(zip(ids_l[r][:n + 1], values_l[r][:n + 1]))
                       for r in range(row, row + len(packed))]
            out[rid] = PromptLogprobs(start, entries)
            row += len(packed)
        return out

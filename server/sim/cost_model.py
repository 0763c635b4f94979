"""Step time from a step's shape: a roofline of FLOPs and bytes, plus host overhead.

    time = max(flops / (peak * compute_efficiency),
               bytes / (bandwidth * memory_efficiency))
           + step_overhead + per_request * requests + per_prefill * prefill_chunks
           + per_token * tokens

A step's shape is, per scheduled request, ``(new_tokens, context_before)``:
the tokens computed this step and those already in its KV cache.

- flops: 2 x layer weights per token, 2 x hidden x vocab per sampled row (the
  LM head), and attention: each new token attends over its context and
  itself, 4 x layers x heads x head_dim FLOPs per (query, key) pair.
- bytes: the weights once per step, plus every request's KV (context and new
  tokens) read or written once.

``fit`` finds the constants from measured steps (least squares on relative
error, non-negative).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tokenbudget.server.sim.profiles import CostConstants, HardwareProfile, ModelProfile

Shape = Sequence[tuple[int, int]]


@dataclass(slots=True)
class StepTerms:
    """The roofline's inputs for one step."""

    flops: float
    bytes: float
    num_requests: int
    num_tokens: int
    # Requests computing more than one token (a prompt chunk): their
    # attention takes another path than a decode's.
    num_prefills: int = 0


class CostModel:
    def __init__(
        self, model: ModelProfile, hardware: HardwareProfile, constants: CostConstants
    ) -> None:
        self.model = model
        self.hardware = hardware
        self.constants = constants
        m = model
        self._flops_per_token = 2.0 * m.layer_params
        self._flops_per_row = 2.0 * m.hidden_size * m.vocab_size
        self._flops_per_pair = 4.0 * m.num_layers * m.num_heads * m.head_dim
        self._kv_bytes = float(m.kv_bytes_per_token)
        self._weight_bytes = float(m.weight_bytes)
        c = constants
        self._s_per_flop = 1.0 / (hardware.peak_flops * c.compute_efficiency)
        self._s_per_byte = 1.0 / (hardware.memory_bandwidth * c.memory_efficiency)

    def terms(self, shape: Iterable[tuple[int, int]]) -> StepTerms:
        tokens = requests = prefills = 0
        pairs = context = 0
        for n, c in shape:
            tokens += n
            requests += 1
            prefills += n > 1
            pairs += n * c + n * (n + 1) // 2
            context += c + n
        return self.terms_from_sums(tokens, requests, pairs, context, prefills)

    def terms_from_sums(
        self, tokens: int, requests: int, pairs: int, context: int, prefills: int = 0
    ) -> StepTerms:
        """``pairs``: sum over requests of n*c + n(n+1)/2; ``context``: sum of
        c + n; ``prefills``: requests with n > 1."""
        flops = (
            self._flops_per_token * tokens
            + self._flops_per_row * requests
            + self._flops_per_pair * pairs
        )
        return StepTerms(
            flops, self._weight_bytes + self._kv_bytes * context, requests, tokens, prefills
        )

    def step_time(self, shape: Iterable[tuple[int, int]]) -> float:
        return self.time_of(self.terms(shape))

    def time_of(self, t: StepTerms) -> float:
        c = self.constants
        return (
            max(t.flops * self._s_per_flop, t.bytes * self._s_per_byte)
            + c.step_overhead_s
            + c.per_request_s * t.num_requests
            + c.per_prefill_s * t.num_prefills
            + c.per_token_s * t.num_tokens
        )


@dataclass(slots=True)
class FitReport:
    constants: CostConstants
    # Relative error |predicted - measured| / measured per step.
    mean_abs_rel_error: float
    max_abs_rel_error: float
    # Per shape group: (median measured s, median predicted s, relative error).
    groups: dict[str, tuple[float, float, float]]

    @property
    def max_group_error(self) -> float:
        return max((e for _, _, e in self.groups.values()), default=0.0)

    def to_dict(self) -> dict:
        return {
            "constants": self.constants.to_dict(),
            "mean_abs_rel_error": self.mean_abs_rel_error,
            "max_abs_rel_error": self.max_abs_rel_error,
            "max_group_error": self.max_group_error,
            "groups": {
                k: {"measured_s": m, "predicted_s": p, "rel_error": e}
                for k, (m, p, e) in self.groups.items()
            },
        }


def _nnls(a, b):
    """Least squares with non-negative coefficients (Lawson-Hanson, scipy's)."""
    from scipy.optimize import nnls

    x, _ = nnls(a, b)
    return x


# Bound assignments tried by fit: one per threshold between steps' ratios.
_MAX_THRESHOLDS = 64


def fit(
    model: ModelProfile,
    hardware: HardwareProfile,
    steps: Sequence[tuple[Shape, float]],
    groups: Sequence[str] | None = None,
) -> FitReport:
    """Fit CostConstants to measured ``(shape, seconds)`` steps.

    The max() makes the model piecewise linear: a step is compute bound when
    its flops/bytes ratio is at or above ``inv_memory_eff / inv_compute_eff``,
    so every possible assignment of steps to bounds is a threshold on that
    ratio. Each threshold's linear problem is solved (non-negative least
    squares on relative error, each of ``groups`` weighing the same) and the
    constants whose max() model fits best win. Alternating between assigning
    and solving instead gets stuck: from a wrong first assignment the solve
    can zero the compute term, after which every step looks memory bound."""
    import numpy as np

    probe = CostModel(model, hardware, CostConstants(1.0, 1.0))
    terms = [probe.terms(shape) for shape, _ in steps]
    flops = np.array([t.flops for t in terms]) / hardware.peak_flops
    nbytes = np.array([t.bytes for t in terms]) / hardware.memory_bandwidth
    # The linear terms: step, per request, per token, per prefill chunk.
    rest = np.array([(1.0, t.num_requests, t.num_tokens, t.num_prefills) for t in terms])
    y = np.array([s for _, s in steps])
    w = _group_weights(groups, len(y))
    x = _best_threshold_fit(flops, nbytes, rest, y, w)
    inv_c, inv_m = x[0], x[1]
    constants = CostConstants(
        compute_efficiency=1.0 / inv_c if inv_c > 0 else float("inf"),
        memory_efficiency=1.0 / inv_m if inv_m > 0 else float("inf"),
        step_overhead_s=float(x[2]),
        per_request_s=float(x[3]),
        per_token_s=float(x[4]),
        per_prefill_s=float(x[5]),
    )
    fitted = CostModel(model, hardware, constants)
    pred = np.array([fitted.time_of(t) for t in terms])
    rel = np.abs(pred - y) / y
    by_group: dict[str, tuple[float, float, float]] = {}
    if groups is not None:
        labels = np.array(groups)
        for g in dict.fromkeys(groups):
            sel = labels == g
            m, p = float(np.median(y[sel])), float(np.median(pred[sel]))
            by_group[g] = (m, p, abs(p - m) / m)
    return FitReport(constants, float(rel.mean()), float(rel.max()), by_group)


def _group_weights(groups: Sequence[str] | None, n: int):
    """Every shape group weighs the same, however many steps it has."""
    import numpy as np

    if groups is None:
        return np.ones(n)
    counts: dict[str, int] = {}
    for g in groups:
        counts[g] = counts.get(g, 0) + 1
    return np.sqrt(np.array([1.0 / counts[g] for g in groups]))


def _best_threshold_fit(flops, nbytes, rest, y, w):
    """Coefficients (1/compute_eff, 1/memory_eff, then ``rest``'s) of the
    best-fitting bound threshold (see fit)."""
    import numpy as np

    ratio = flops / nbytes
    cuts = np.unique(ratio)
    if len(cuts) > _MAX_THRESHOLDS:
        cuts = np.unique(np.quantile(ratio, np.linspace(0, 1, _MAX_THRESHOLDS)))
    best, x = float("inf"), np.zeros(2 + rest.shape[1])
    for cut in [*cuts, np.inf]:
        compute_bound = ratio >= cut
        a = np.concatenate(
            [
                np.where(compute_bound, flops, 0.0)[:, None],
                np.where(compute_bound, 0.0, nbytes)[:, None],
                rest,
            ],
            axis=1,
        )
        sol = _nnls(a * (w / y)[:, None], w)
        pred = np.maximum(flops * sol[0], nbytes * sol[1]) + rest @ sol[2:]
        err = float(np.sum((w * (pred - y) / y) ** 2))
        # Ties (within rounding) keep the earlier cut: the result does not
        # hang on the last bits of a solve.
        if err < best * (1 - 1e-9):
            best, x = err, sol
    return x

"""A calibrated simulator for capacity planning: the real Scheduler and
EngineCore driven by a simulated executor whose step time comes from a cost
model (a roofline of the step's FLOPs and bytes for a model shape on a
hardware profile, plus host overhead). Simulated time, deterministic per
seed; no torch (calibration measures a real worker and imports it lazily).

    python -m tokenbudget.server.sim simulate --help
    python -m tokenbudget.server.sim calibrate --help
"""

from tokenbudget.server.sim.cost_model import CostModel, FitReport, StepTerms, fit
from tokenbudget.server.sim.executor import SimClock, SimulatedExecutor, sim_token
from tokenbudget.server.sim.profiles import (
    GPU_DEFAULT_CONSTANTS,
    HARDWARE,
    MODELS,
    CostConstants,
    HardwareProfile,
    ModelProfile,
    get_hardware,
    get_model,
)
from tokenbudget.server.sim.simulate import ROUTERS, Router, SimResult, simulate
from tokenbudget.server.engine.trace import TraceRecorder, TraceRequest, load_trace
from tokenbudget.server.sim.traces import (
    merge,
    multi_turn_chat,
    poisson_arrivals,
    sharegpt_like,
    with_slo,
)

__all__ = [
    "CostConstants",
    "CostModel",
    "FitReport",
    "GPU_DEFAULT_CONSTANTS",
    "HARDWARE",
    "HardwareProfile",
    "MODELS",
    "ModelProfile",
    "ROUTERS",
    "Router",
    "SimClock",
    "SimResult",
    "SimulatedExecutor",
    "StepTerms",
    "TraceRecorder",
    "TraceRequest",
    "fit",
    "get_hardware",
    "get_model",
    "load_trace",
    "merge",
    "multi_turn_chat",
    "poisson_arrivals",
    "sharegpt_like",
    "sim_token",
    "simulate",
    "with_slo",
]

"""mpstream: single-machine pipeline parallelism on dedicated CUDA streams.

Each stage computes on its own stream, each cross-device copy runs on copy
streams, and CUDA events from a small C++ scheduler order everything, so one
micro-batch's copy overlaps the next one's compute.
"""

from __future__ import annotations

from ._ext import ExtensionError
from ._version import __version__
from .balance import balance_by_size, balance_by_time
from .batchnorm import DeferredBatchNorm
from .capture import CapturedStep
from .checkpoint import is_checkpointing, is_recomputing
from .cost_model import Costs, Simulation, simulate
from .cost_model import fit as simulate_fit
from .graph import Ref, StageGraph
from .microbatch import NoChunk
from .pipe import Pipe
from .plan import Plan, PlanError, record_plan, verify_plan
from .profiling import profile
from .scaling import Prediction, predict
from .schedule import SCHEDULES, Kind, Schedule, Task, Topology
from .scheduler import EventScheduler, PlanOp
from .timeline import Span, Summary, Timeline
from .tuning import TuneResult, tune

__all__ = [
    "Pipe",
    "CapturedStep",
    "NoChunk",
    "StageGraph",
    "Ref",
    "Topology",
    "profile",
    "tune",
    "TuneResult",
    "simulate",
    "simulate_fit",
    "predict",
    "Costs",
    "Prediction",
    "Simulation",
    "Timeline",
    "Span",
    "Summary",
    "balance_by_time",
    "balance_by_size",
    "DeferredBatchNorm",
    "is_checkpointing",
    "is_recomputing",
    "EventScheduler",
    "Schedule",
    "SCHEDULES",
    "Task",
    "Kind",
    "Plan",
    "PlanOp",
    "PlanError",
    "record_plan",
    "verify_plan",
    "ExtensionError",
    "__version__",
]

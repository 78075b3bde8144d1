"""mpstream: single-machine pipeline parallelism on dedicated CUDA streams.

Each stage computes on its own stream, each cross-device copy runs on copy
streams, and CUDA events from a small C++ scheduler order everything, so one
micro-batch's copy overlaps the next one's compute.

The package's folders are its layers. The core, bottom up: ``schedules``
(which task runs when), ``memory`` (checkpointing, deferred BatchNorm, saved
bytes), ``runtime`` (one run on streams and events: scatter, schedule, stage
compute, copy, gather), ``stages`` (cutting a module into stages),
``pipe`` (the ``nn.Module``), ``capture`` (CUDA graphs) and
``distributed`` (DDP). The tools build on it: ``observe`` (profiles,
timelines, the cost model, tuning), ``tutorial`` (the tutorial's models and
experiment), ``doctor`` and ``cli``. This module re-exports the public API.
"""

from __future__ import annotations

from ._ext import ExtensionError
from ._version import __version__
from .capture import CapturedStep
from .memory import DeferredBatchNorm, is_checkpointing, is_recomputing
from .observe import (
    Costs,
    Prediction,
    Simulation,
    Span,
    Summary,
    Timeline,
    TuneResult,
    predict,
    profile,
    simulate,
    tune,
)
from .observe import fit as simulate_fit
from .pipe import Pipe, SingleMicroBatchWarning
from .runtime import (
    EventScheduler,
    GraphReport,
    GraphWarning,
    NoChunk,
    Plan,
    PlanError,
    PlanOp,
    Ref,
    StageGraph,
    record_plan,
    verify_plan,
)
from .schedules import SCHEDULES, Kind, Schedule, Task, Topology
from .stages import SplitReport, balance_by_size, balance_by_time

__all__ = [
    "Pipe",
    "SplitReport",
    "CapturedStep",
    "GraphReport",
    "GraphWarning",
    "SingleMicroBatchWarning",
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

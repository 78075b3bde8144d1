"""mpstream: single-machine pipeline parallelism on dedicated CUDA streams.

Each stage computes on its own stream, each cross-device copy runs on copy
streams, and CUDA events from a small C++ scheduler order everything, so one
micro-batch's copy overlaps the next one's compute.
"""

from __future__ import annotations

from ._ext import ExtensionError
from .balance import balance_by_size, balance_by_time
from .batchnorm import DeferredBatchNorm
from .pipe import Pipe
from .plan import Plan, PlanError, record_plan, verify_plan
from .schedule import SCHEDULES, Kind, Schedule, Task
from .scheduler import EventScheduler, PlanOp, TaskTiming

__version__ = "0.1.0"

__all__ = [
    "Pipe",
    "balance_by_time",
    "balance_by_size",
    "DeferredBatchNorm",
    "EventScheduler",
    "Schedule",
    "SCHEDULES",
    "Task",
    "Kind",
    "Plan",
    "PlanOp",
    "PlanError",
    "TaskTiming",
    "record_plan",
    "verify_plan",
    "ExtensionError",
    "__version__",
]

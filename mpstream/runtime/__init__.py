"""The runtime: one pipeline run, from micro-batches in to outputs out.

What a run does, in data-path order: :mod:`.microbatch` scatters the batch;
:mod:`.scheduler` (over the C++ ``Scheduler``) orders the streams with
events, after the previous call's caller streams (:mod:`.callers`);
:mod:`.executor`, the one run loop, walks a schedule, handing each task to
what the run does: :mod:`.forward` for ``pipe(x)``, :mod:`.training`
for a training step, over the stages a :mod:`.worker` holds, calling each
stage (:mod:`.calls`) with its arguments wired by :mod:`.graph` and
:mod:`.values`; :mod:`.hops` (every copy task), :mod:`.copy` (one ``send``
for every copy, either way) and :mod:`.transfer` move values between
devices and from the host; :mod:`.boundary` and :mod:`.split_backward` cut
and split the backward; :mod:`.graphed` replays stage calls from CUDA
graphs instead of issuing their kernels (driven by :mod:`.replayed` in a
training step, by :mod:`.replay_autograd` inside autograd in the user's own loop,
reading what :mod:`.handoffs` says is handed on in place);
:mod:`.gathering` gathers.
:mod:`.plan` records and verifies a run's stream operations without a
device. :mod:`.stream` makes CPU and CUDA look alike, :mod:`.errors` and
:mod:`.marks` say where a failure and a backward happened, and
:mod:`.private` holds every private torch call mpstream makes.

May import :mod:`mpstream.schedules`, :mod:`mpstream.memory` and the
extension loader; never the stages, the pipe or any tool.
"""

from __future__ import annotations

from .boundary import GradSink, cut
from .errors import annotate
from .graph import Ref, StageGraph
from .graphed import GraphReport, GraphWarning
from .microbatch import NoChunk, Value, as_value
from .plan import Plan, PlanError, record_plan, verify_plan
from .private import PrivateApiError, missing
from .scheduler import EventScheduler, PlanOp
from .split_backward import backward_inputs
from .stream import explicit_device, synchronize

__all__ = [
    "GraphReport",
    "GraphWarning",
    "NoChunk",
    "Value",
    "as_value",
    "StageGraph",
    "Ref",
    "EventScheduler",
    "PlanOp",
    "Plan",
    "PlanError",
    "record_plan",
    "verify_plan",
    "GradSink",
    "cut",
    "backward_inputs",
    "synchronize",
    "explicit_device",
    "PrivateApiError",
    "missing",
    "annotate",
]

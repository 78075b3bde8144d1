"""Graphed stages: a pipe's stage calls replayed from CUDA graphs.

:mod:`.stages` keeps each stage's graphs, one set per micro-batch slot and
call signature, and decides per call whether to replay, capture or run
eagerly; :mod:`.call` holds one call's static buffers and replays them
inside autograd; :mod:`.passes` is what a captured backward computes (all
of it, or a zero-bubble schedule's input and weight passes apart);
:mod:`.backends` captures them (CUDA graphs, or an emulation for tests),
:mod:`.restore` puts back what capture changed on the stage (buffers,
deferred BatchNorm counters, random state), :mod:`.capturing` undoes a CUDA
capture that fails and :mod:`.rng` orders, per device, the graph work that
shares the CUDA generator's graph state;
:mod:`.grads` sums a stage's parameter gradients over a training step;
:mod:`.keys` is what a capture baked in (a stage's fingerprint, a call's
signature) and :mod:`.report` what the stages report.

Part of the runtime: may import its sibling modules, the schedules and the
memory policies; the worker and the training step call it.
"""

from __future__ import annotations

from .backends import CudaGraphs, Emulated
from .call import Backend, GraphedCall
from .grads import Switch
from .keys import Fingerprint
from .report import GraphReport, GraphWarning, StageReport
from .stages import MAX_CALLS, MAX_GENERATIONS, StageGraphs

__all__ = [
    "Backend",
    "CudaGraphs",
    "Emulated",
    "Fingerprint",
    "GraphReport",
    "GraphWarning",
    "GraphedCall",
    "MAX_CALLS",
    "MAX_GENERATIONS",
    "StageGraphs",
    "StageReport",
    "Switch",
]

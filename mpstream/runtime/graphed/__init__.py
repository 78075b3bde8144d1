"""Graphed stages: a pipe's stage calls replayed from CUDA graphs.

:mod:`.stages` keeps each stage's graphs, one set per micro-batch slot and
call signature, decides per call whether to replay, capture or run
eagerly, and reports (:mod:`.report`); :mod:`.state` is one stage's
graphs and the checks a run begins with; :mod:`.call` holds one call's
static buffers, replays them (from a training step's tasks, or inside
autograd in the user's loop);
:mod:`.backends` captures them with CUDA graphs and says what each pass
computes, :mod:`.emulated` emulates them for tests; :mod:`.grads` is a stage's gradient buffers,
which the graphs add into and ``.grad`` views (laid out and saved by
:mod:`.grad_buffers`), :mod:`.tied` tied
parameters' side buffers, :mod:`.passes` the ends of the backward passes
they take part in; :mod:`.zeroing` tells the stores ``.grad`` changed within a pass
(``Pipe.zero_grad``); :mod:`.capturing` puts back what capture changed
on the stage, orders the graph work sharing the CUDA
generator's state and undoes a failed capture; :mod:`.keys` is what a
capture baked in and how a run notices it changed.

Part of the runtime: may import its sibling modules, the schedules and the
memory policies; a forward run's and a training step's tasks call it.
"""

from __future__ import annotations

from .backend import Backend
from .backends import CudaGraphs
from .call import GraphedCall
from .emulated import Emulated
from .grads import GradStore
from .keys import generation
from .report import GraphReport, GraphWarning, StageReport
from .stages import MAX_CALLS, MAX_GENERATIONS, StageGraphs
from .zeroing import grads_zeroed

__all__ = [
    "Backend",
    "CudaGraphs",
    "Emulated",
    "GradStore",
    "GraphReport",
    "GraphWarning",
    "GraphedCall",
    "MAX_CALLS",
    "MAX_GENERATIONS",
    "StageGraphs",
    "StageReport",
    "generation",
    "grads_zeroed",
]

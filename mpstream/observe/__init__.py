"""Observability and the cost model: what a pipeline did, and what it would do.

:mod:`.profiling` times every task of every stream (``mpstream.profile``) into
a :mod:`.timeline` (summaries, Chrome traces, Gantt charts);
:mod:`.cost_model` simulates a schedule on modelled streams and fits its
costs to a profile; :mod:`.scaling` predicts more devices from per-layer
costs; :mod:`.tuning` sweeps the split size; :mod:`.compare` sets the
schedules side by side, with what :mod:`.measuring` measures of them on a
real pipe; :mod:`.auto` chooses the schedule of ``Pipe(schedule="auto")``
(installed as the Pipe's chooser when this package is imported: the core
may not import it); :mod:`.figures` draws (it imports no other mpstream
module, so every tool may call it without an import circle).

A tool package: it builds on the core only through what the core packages
export (``mpstream.pipe``, ``mpstream.runtime``, ...); the core never imports it.
"""

from __future__ import annotations

from ..pipe import install_chooser
from .auto import choose_schedule
from .cost_model import Simulation, micro_batches, simulate
from .fitting import Costs, fit
from .profiling import Profile, profile
from .scaling import Prediction, predict
from .summary import Summary
from .timeline import Span, Timeline
from .tuning import TuneResult, tune

__all__ = [
    "profile",
    "Profile",
    "Timeline",
    "Span",
    "Summary",
    "simulate",
    "micro_batches",
    "fit",
    "Costs",
    "Simulation",
    "predict",
    "Prediction",
    "tune",
    "TuneResult",
    "choose_schedule",
]

# schedule="auto" asks the cost model, which the core cannot import.
install_chooser(choose_schedule)

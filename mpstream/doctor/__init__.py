"""``mpstream doctor``: proves on this machine's devices that the pipeline is
right and overlaps, and records the evidence.

:mod:`.runner` runs the eight steps in order and writes the report
(:mod:`.report`); each step is a module: :mod:`.environment`,
:mod:`.checks` (correctness), :mod:`.probes` (overlap, judged by
:mod:`.overlap`), :mod:`.sanitizer`, :mod:`.soak` (memory),
:mod:`.experiment` (the tutorial's), :mod:`.attribution` (where the time
goes) and :mod:`.modelcheck` (the cost model). :mod:`.diagnosis` is their
shared vocabulary: statuses, checks, step results.

A tool package: it builds on the core through what the core packages export,
and on :mod:`mpstream.observe` and :mod:`mpstream.tutorial`; nothing below it
imports it.
"""

from __future__ import annotations

from .runner import (
    ARCHS,
    NAMES,
    SKIPPABLE,
    STEPS,
    Options,
    Step,
    check,
    run,
    run_step,
    sized,
)

__all__ = [
    "Step",
    "STEPS",
    "NAMES",
    "SKIPPABLE",
    "ARCHS",
    "Options",
    "check",
    "sized",
    "run_step",
    "run",
]

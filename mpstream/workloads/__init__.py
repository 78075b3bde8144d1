"""Workloads beyond the tutorial's: a decoder-only transformer, the model
people pipeline on one machine today, with its bench (``mpstream bench
--model transformer``) and its memory per stage.

:mod:`.transformer` is the model and its presets, :mod:`.memory` what a
stage holds in a step, :mod:`.bench` the side-by-side timing, :mod:`.report`
its figures, table and files. A tool: it
builds on the pipe and the tutorial's timing rounds and device detection.
"""

from __future__ import annotations

from .bench import Config, Results, run
from .report import save, table
from .transformer import PRESETS, NaiveParallel, Preset, decoder, halves, loss_fn, preset, tokens

__all__ = [
    "Config",
    "NaiveParallel",
    "PRESETS",
    "Preset",
    "Results",
    "decoder",
    "halves",
    "loss_fn",
    "preset",
    "run",
    "save",
    "table",
    "tokens",
]

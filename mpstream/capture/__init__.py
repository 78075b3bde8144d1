"""Graph capture: a pipe's whole training step captured in a CUDA graph.

:mod:`.step` holds :class:`CapturedStep` (warm-up, capture, replay);
:mod:`.buffers` its static input and target buffers; :mod:`.state` saves and
restores what the warm-up changes and checks what a replay could not
reproduce; :mod:`.edges` captures a step as one graph per segment of each
group of stages, ordered by external events.

May import :mod:`mpstream.pipe` and the core below it; never a tool.
"""

from __future__ import annotations

from .step import CapturedStep

__all__ = ["CapturedStep"]

"""Graph capture: a pipe's whole training step captured in a CUDA graph.

:mod:`.step` holds :class:`CapturedStep` (static buffers, warm-up, capture,
replay); :mod:`.state` saves and restores what the warm-up changes and checks
the optimizer for what a replay could not reproduce.

May import :mod:`mpstream.pipe` and the core below it; never a tool.
"""

from __future__ import annotations

from .step import CapturedStep

__all__ = ["CapturedStep"]

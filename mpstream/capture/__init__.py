"""Graph capture: a pipe's whole training step replayed from CUDA graphs.

:mod:`.step` holds :class:`CapturedStep` (its checks and replays);
:mod:`.warmup` warms a step up and captures it, undone if either fails;
:mod:`.buffers` its static input and target buffers; :mod:`.state` saves and
restores what the warm-up changes and checks what a replay could not
reproduce; :mod:`.devices` says which devices a step can be captured on
and captures what a step issues around graphed stages (the zeroing, the
optimizer's update) as one graph per device.

May import :mod:`mpstream.pipe` and the core below it; never a tool.
"""

from __future__ import annotations

from .step import CapturedStep

__all__ = ["CapturedStep"]

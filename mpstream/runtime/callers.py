"""A call of a pipe made from another stream than the previous call's.

A run orders itself after its caller's current stream only (the source
event the scheduler records there, ``csrc/scheduler.cpp`` ``begin_run``).
What the previous call left for its own caller is read on that caller's
stream, after the call returned or at its very end: a graphed pipe's
outputs are the replays' buffers until ``gather`` concatenates them (or
``finish`` copies a single micro-batch's) on the caller's stream, and the
parameter gradients (a graphed stage's ``.grad`` views the buffers its
graphs add into) are read by the caller's optimizer step. A next call made
from another stream would let its replays and gradient adds overtake those
reads. :class:`CallerStreams` makes such a call's current stream wait on
the previous call's first, before the call issues anything: the run's
source events then imply it.

Host cost: one current-stream lookup per CUDA device per call; the wait
only when the stream changed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .stream import AnyStream, capturing, current_stream

__all__ = ["CallerStreams"]


class CallerStreams:
    """The streams the latest call of one pipe was made from, per CUDA device.

    Args:
        devices: the pipe's caller devices (one per device its stages use);
            only CUDA ones have streams to follow.
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = [d for d in devices if d.type == "cuda"]
        #: Per CUDA device, the current stream of the latest call (None
        #: before the first).
        self.latest: list[AnyStream] | None = None

    def follow(self) -> None:
        """Called as a call starts: where the calling thread's current
        stream differs from the latest call's, it waits on that one.

        Nothing is waited on or remembered while a CUDA graph captures the
        call: an event recorded outside a capture cannot be waited on inside
        it, and the graph's replays run wherever the user replays them.
        """
        if not self.devices:
            return
        now = [current_stream(d) for d in self.devices]
        latest = self.latest
        if now == latest:
            return
        if capturing(self.devices):
            return
        if latest is not None:
            for new, old in zip(now, latest):
                if new != old:
                    new.wait_stream(old)  # type: ignore[union-attr, arg-type]
        self.latest = now

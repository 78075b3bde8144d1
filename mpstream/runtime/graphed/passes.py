"""The ends of the backward passes that gradient stores take part in.

**Gradients taken back** (``torch.autograd.grad``, ``backward(inputs=)``): a
store puts its buffers back on the stage's stream, and :class:`CallerWaits`,
a final callback of that backward's, orders the caller's streams after that
(autograd runs final callbacks on the streams that were current around the
call, after ordering them after the streams it accumulated leaf gradients
on, but not after the stage's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..stream import AnyStream, CPUStream, current_stream

__all__ = ["CallerWaits", "after"]


def after(stream: AnyStream, producers: Iterable[torch.cuda.Stream]) -> None:
    """Orders ``stream`` after the work issued so far on ``producers``."""
    if not isinstance(stream, CPUStream):
        for producer in producers:
            if producer != stream:
                stream.wait_stream(producer)


def _queue(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class CallerWaits:
    """Orders the streams current when the running backward pass ends (the
    caller's) after the streams a store put gradients back on within it:
    one final callback per store and pass."""

    __slots__ = ("task", "streams", "done")

    def __init__(self, task: int) -> None:
        self.task = task
        self.streams: dict[int, torch.cuda.Stream] = {}
        self.done = False

    @classmethod
    def note(cls, waits: CallerWaits | None, task: int, stream: AnyStream) -> CallerWaits | None:
        """Notes a put-back on ``stream`` in pass ``task``; returns the
        callback to keep (``waits`` if it is that pass's and has not run,
        else a new one, queued). None on the CPU, which needs no order."""
        if isinstance(stream, CPUStream):
            return waits
        if waits is None or task == -1 or waits.task != task or waits.done:
            waits = cls(task)
            _queue(waits)
        waits.streams[stream.stream_id] = stream
        return waits

    def __call__(self) -> None:
        self.done = True
        for stream in self.streams.values():
            after(current_stream(stream.device), [stream])

"""Per-device order of the graph work that shares the CUDA generator's graph scalars.

Before torch 2.13 (``aten/src/ATen/cuda/CUDAGeneratorImpl.cpp``), a device's
default CUDA generator keeps one pair of device scalars, seed and offset, for
every CUDA graph captured on that device. A graph's random kernels (dropout)
read them when they run. They are written, on the current stream:

- by every ``capture_begin``, random or not (its generator prologue fills
  them before the stream capture starts);
- by every replay of a graph that draws random numbers (its replay prologue
  fills them with the generator's current offset, then launches the graph).

Stages sharing a device capture and replay on streams of their own. If
nothing orders those writes, one stage's fill can land while another's graph
is still reading the scalars, and that graph draws another dropout mask than
the eager pipe would; CUDA's sanitizer reports the two streams writing the
same tensor, too. :func:`ordered` chains these sections per device, in the
order the host issues them (the order the eager pipe draws its numbers in,
which replay already follows): a section's stream first waits on an event
recorded after the device's previous section, and the event is recorded
again after it. Nothing else waits, so graphs that draw nothing still
overlap freely. (From torch 2.13 each capture has scalars of its own; the
order is then merely unneeded.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import torch

__all__ = ["RngOrder", "ordered"]


class _Stream(Protocol):
    def wait_event(self, event: Any) -> Any: ...


class _Event(Protocol):
    def record(self, stream: Any = None) -> Any: ...


class RngOrder:
    """One device's chain of sections that touch its generator's graph scalars.

    Sections are serialised on the device (an event each section's stream
    waits on, then records) and on the host, so that a wait, its work and
    its record are never interleaved with another thread's (backward
    replays run on autograd's device thread; the issuing thread waits for
    them, so the lock is normally free). A capture's section holds the lock
    while autograd's device thread runs the captured backward, which enters
    no section. Waits and records are issued outside any stream capture:
    issued on a capturing stream they would become nodes of the graph. The
    caller opens the section before ``capture_begin`` and closes it after
    ``capture_end``.

    Args:
        stream: the device's current stream (where the section's work goes).
        event: makes the event, on its first record.
        capturing: whether the current stream is capturing (then no record).
    """

    def __init__(
        self,
        stream: Callable[[], _Stream],
        event: Callable[[], _Event],
        capturing: Callable[[], bool],
    ) -> None:
        self._stream = stream
        self._new_event = event
        self._capturing = capturing
        self._event: _Event | None = None
        self._lock = threading.RLock()

    @contextmanager
    def section(self) -> Iterator[None]:
        """Runs what is inside after the device's previous section, on the
        device as on the host."""
        with self._lock:
            stream = self._stream()
            if self._event is not None:
                stream.wait_event(self._event)
            try:
                yield
            finally:
                # Recorded on failure too: what the section enqueued before it
                # failed (a capture's prologue) still precedes the next one.
                if not self._capturing():
                    if self._event is None:
                        self._event = self._new_event()
                    self._event.record(stream)


_orders: dict[int, RngOrder] = {}
_orders_lock = threading.Lock()


def ordered(device: torch.device) -> AbstractContextManager[None]:
    """The section of ``device``'s order (see :class:`RngOrder`); nothing
    for a device that is not a CUDA one."""
    if device.type != "cuda":
        return nullcontext()
    index = torch.cuda.current_device() if device.index is None else device.index
    with _orders_lock:
        order = _orders.get(index)
        if order is None:
            order = _orders[index] = RngOrder(
                lambda: torch.cuda.current_stream(index),
                torch.cuda.Event,
                torch.cuda.is_current_stream_capturing,
            )
    return order.section()

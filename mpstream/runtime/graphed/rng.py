"""The order of what touches a device's random-number graph state.

Before torch 2.13 (``aten/src/ATen/cuda/CUDAGeneratorImpl.cpp``) a
device's default CUDA generator keeps one pair of device scalars, seed and offset, for every
graph captured on it, which a graph's random kernels (dropout) read. They
are written on the current stream by every ``capture_begin`` (its prologue)
and by every replay of a graph that draws (its replay prologue). Stages
sharing a device capture and replay on streams of their own; unordered,
one stage's fill can land while another's graph still reads the scalars,
which then draws another mask than the eager pipe (and CUDA's sanitizer
reports two streams writing one tensor). :func:`ordered` chains these
sections per device in the order the host issues them (the eager pipe's
order): a section's stream waits on an event recorded after the device's
previous section, and records it again after. Graphs that draw nothing
still overlap freely. From torch 2.13 each capture has scalars of its
own, and no order is kept (:data:`SHARED_SCALARS`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import torch

__all__ = ["RngOrder", "SHARED_SCALARS", "SECTION_TIMEOUT", "ordered"]


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
    until its capture ends (its record must follow the capture's prologue),
    so a thread that needs a section meanwhile waits; one that waits past
    a timeout raises instead of hanging. Waits and records are issued outside any stream capture:
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
        self._holder = ""  # the thread in a section, for the message below

    @contextmanager
    def section(self, timeout: float | None = None) -> Iterator[None]:
        """Runs what is inside after the device's previous section, on the
        device as on the host.

        Raises:
            RuntimeError: another thread's section held the order for
                ``timeout`` seconds (default :data:`SECTION_TIMEOUT`): a
                deadlock (see :func:`ordered`) said instead of hanging.
        """
        wait = SECTION_TIMEOUT if timeout is None else timeout
        if not self._lock.acquire(timeout=wait):
            raise RuntimeError(
                f"waited {wait:g} s for thread {self._holder!r} to leave its section of "
                f"this device's random-number order (a capture or a replay that draws): "
                f"with torch < 2.13 a graphed stage nested in another, or a backward run "
                f"inside a captured forward, waits for itself this way; un-nest the graphed "
                f"modules, or use torch >= 2.13, which needs no order"
            )
        holder, self._holder = self._holder, threading.current_thread().name
        try:
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
        finally:
            self._holder = holder
            self._lock.release()


#: Whether a device's graphs share one pair of generator scalars (torch
#: before 2.13; see the module), which :func:`ordered` then orders.
SHARED_SCALARS: bool = torch.__version__ < (2, 13)  # type: ignore[operator]
#: Seconds a section waits for another thread's before calling it a deadlock
#: (a capture of the largest stage takes seconds).
SECTION_TIMEOUT = 300.0

_orders: dict[int, RngOrder] = {}
_orders_lock = threading.Lock()


def ordered(device: torch.device) -> AbstractContextManager[None]:
    """The section of ``device``'s order (see :class:`RngOrder`); nothing
    for a device that is not a CUDA one, or with a torch whose captures
    each have generator scalars of their own (2.13 on): then no lock is
    held across a capture at all."""
    if device.type != "cuda" or not SHARED_SCALARS:
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

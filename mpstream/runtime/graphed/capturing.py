"""Capturing a stage call safely: the stage put back, the random state's
order kept, a failed capture undone.

**The stage put back** (:func:`restored`). Warm-up and capture run the
stage, which changes it: BatchNorm updates its running statistics, a
:class:`~mpstream.memory.batchnorm.DeferredBatchNorm` counts the
micro-batch, dropout draws from the generators. None of that is a call the
user made, so it is all put back once capture ends, succeeded or not.

**The random state's order** (:func:`ordered`). Before torch 2.13
(``aten/src/ATen/cuda/CUDAGeneratorImpl.cpp``) a device's default CUDA
generator keeps one pair of device scalars, seed and offset, for every
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

**A failed capture undone** (:func:`capturing`). A stage whose capture
fails (a host sync such as ``.item()`` invalidates it) runs eagerly from
then on, so the failure must leave torch as it found it, which
``CUDAGraph`` does not see to (as of torch 2.11,
``aten/src/ATen/cuda/CUDAGraph.cpp``): ``capture_begin`` puts the device's
generator in capture mode, routes the caching allocator's allocations on
the capturing stream to the graph's pool (taking a use of the pool) and
begins the stream capture; on an invalidated capture, ``capture_end``
raises before it ends the routing and before the generator's epilogue, and
the graph's destructor releases the pool only after a capture that ended.
Left so, the allocator believes a capture is still underway
(``torch.cuda.empty_cache`` fails an assertion; frees deferred by
``record_stream`` never happen) and the generator stays in capture mode (an
eager dropout raises). Undone in this order:

1. the stream capture is ended, if the body raised while it was underway
   (``capture_end``, whose error only repeats the body's failure);
2. unless the graph did end its capture (its ``pool()`` answers), the graph
   is kept alive for good (torch's pinned-memory allocator still holds a
   routing filter that reads it), the allocator's routing to the pool is
   ended and the pool's use released (one is taken once routing began);
3. the generator leaves capture mode through one trivial capture that ends
   properly (torch has no other way; another generator state would leave
   earlier graphs advancing the old one).

The original exception propagates; a cleanup step's expected error (a
routing already ended) is dropped, any other added to it as a note. The
torch calls are :class:`TorchCapture`'s, so tests give a fake and check
the order without a GPU.

**A captured graph's lifetime.** A capture that ends hands its graph to
:data:`~.lifetimes.LIFETIMES` with its owner: it is destroyed only with
the other graphs captured on its stream (:mod:`.lifetimes` says why).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import torch
from torch import nn

from ...memory.batchnorm import DeferredBatchNorm
from .. import private
from ..errors import annotate
from .lifetimes import LIFETIMES

__all__ = [
    "Graph",
    "CaptureApi",
    "TorchCapture",
    "MAX_KEPT",
    "capturing",
    "RngOrder",
    "SHARED_SCALARS",
    "SECTION_TIMEOUT",
    "ordered",
    "restored",
]


class Graph(Protocol):
    """What :func:`capturing` needs of a graph (``torch.cuda.CUDAGraph``)."""

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None: ...

    def capture_end(self) -> None: ...

    def pool(self) -> Any: ...


#: Graphs whose capture failed (see the module's step 2).
_kept: list[Graph] = []
#: How many failed captures a process keeps alive before it tries no more:
#: each holds its pool's memory for good, and failing this often means the
#: cause (a host sync in a stage, a CPU tensor) is in the model.
MAX_KEPT = 16


class CaptureApi(Protocol):
    """The torch calls that undo a failed capture."""

    def device(self) -> int:
        """The current device (the one ``capture_begin`` routes)."""

    def capturing(self) -> bool:
        """Whether the current stream's capture is underway (or invalidated)."""

    def end_routing(self, device: int, pool: Any) -> None:
        """Ends the allocator's routing to ``pool``; raises if there is none."""

    def release(self, device: int, pool: Any) -> None:
        """Releases one use of ``pool``."""

    def keep(self, graph: Graph) -> None:
        """Keeps a graph whose capture did not end alive for good."""

    def kept(self) -> int:
        """How many graphs :meth:`keep` holds."""

    def reset_generator(self) -> None:
        """Takes the default generator out of capture mode."""

    def adopt(self, graph: Graph, owner: object | None) -> None:
        """Hands a graph whose capture ended to :data:`~.lifetimes.LIFETIMES`,
        owned by ``owner``, captured on the current stream."""

    def hold(self) -> AbstractContextManager[None]:
        """Keeps every graph captured on the current stream while a capture
        on it is underway (see :meth:`~.lifetimes.Lifetimes.pinned`)."""


class TorchCapture:
    """:class:`CaptureApi` on torch's own calls (present from torch 2.8; the
    private ones through :mod:`..private`)."""

    def device(self) -> int:
        return torch.cuda.current_device()

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def end_routing(self, device: int, pool: Any) -> None:
        private.end_allocate_to_pool(device, pool)

    def release(self, device: int, pool: Any) -> None:
        private.release_pool(device, pool)

    def keep(self, graph: Graph) -> None:
        _kept.append(graph)

    def kept(self) -> int:
        return len(_kept)

    def adopt(self, graph: Graph, owner: object | None) -> None:
        LIFETIMES.adopt(graph, _key(), owner)  # the current stream: capture_end checks it

    def hold(self) -> AbstractContextManager[None]:
        return LIFETIMES.pinned(_key())

    def reset_generator(self) -> None:
        # On a side stream: the failed capture may have been begun on the
        # default stream, where no capture may run; the side stream follows
        # the current one and the current one it, so the prologue's writes
        # stay in the order of mpstream.runtime.graphed.rng.
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream(device=current.device)  # type: ignore[no-untyped-call]
        side.wait_stream(current)
        with torch.cuda.stream(side):
            scratch = torch.zeros(1, device=current.device)
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                scratch.add_(1)  # one node: an empty graph warns
            finally:
                graph.capture_end()
            # Nothing owns it: it goes (with its pool) with the stream's others.
            self.adopt(graph, None)
            del graph, scratch
        current.wait_stream(side)


@contextmanager
def capturing(
    graph: Graph,
    pool: Any,
    api: CaptureApi | None = None,
    mode: str = "thread_local",
    owner: object | None = None,
) -> Iterator[None]:
    """Captures what runs inside into ``graph``, allocating from ``pool``, on
    the current stream; a failure is undone as the module says. A graph
    captured is adopted by :data:`~.lifetimes.LIFETIMES` for ``owner``: it
    is destroyed only with every other graph captured on its stream, once
    their owners are all gone (see :mod:`.lifetimes` for why).

    Args:
        graph: the graph to capture into.
        pool: the memory pool's handle (``torch.cuda.graph_pool_handle()``,
            or another graph's ``pool()`` to share it).
        api: the torch calls (a fake in tests).
        mode: CUDA's capture mode: ``thread_local`` (another thread's calls
            are allowed) or ``relaxed`` (this thread's too: for captures
            open side by side, whose beginnings and ends make calls that a
            thread-local capture forbids).
        owner: the object that holds the graph (a stage's call, a captured
            step): the graph is let go when it dies. None: it is let go now
            (it still waits for its stream's other graphs).

    Raises:
        RuntimeError: :data:`MAX_KEPT` captures failed before (nothing is
            begun); or what the capture raised, once undone.
    """
    api = api or TorchCapture()
    if api.kept() >= MAX_KEPT:
        raise RuntimeError(
            f"{api.kept()} graph captures failed in this process, each leaving its graph and "
            f"memory pool alive for good (torch still reads them), so no more are tried; the "
            f"earlier failures' warnings say why (a host sync such as .item() in a stage, a "
            f"tensor on the CPU): fix that, or run the stages eagerly"
        )
    device = api.device()
    with api.hold():
        try:
            graph.capture_begin(pool=pool, capture_error_mode=mode)
        except BaseException as exc:
            _abandon(graph, pool, device, api, began=False, failure=exc)
            raise
        try:
            yield
        except BaseException as exc:
            if api.capturing():
                try:
                    graph.capture_end()
                except RuntimeError:
                    pass  # the body's failure again: the capture it invalidated
            _abandon(graph, pool, device, api, began=True, failure=exc)
            raise
        try:
            graph.capture_end()
        except BaseException as exc:
            _abandon(graph, pool, device, api, began=True, failure=exc)
            raise
        api.adopt(graph, owner)


def _key() -> tuple[int, int]:
    """The current CUDA stream, as :data:`~.lifetimes.LIFETIMES` keys it."""
    stream = torch.cuda.current_stream()
    return (stream.device_index, stream.cuda_stream)


def _abandon(
    graph: Graph, pool: Any, device: int, api: CaptureApi, began: bool, failure: BaseException
) -> None:
    """Steps 2 and 3 of the module's cleanup. ``began``: ``capture_begin``
    returned (so the allocator's routing began and took a use of the pool)."""
    try:
        graph.pool()
    except RuntimeError:
        pass  # the capture did not end: ours to undo
    else:
        # It ended: the graph releases its pool, the generator left capture
        # mode; its stream's other graphs still decide when it goes.
        api.adopt(graph, None)
        return
    api.keep(graph)
    routed = False
    try:
        api.end_routing(device, pool)
        routed = True
    except RuntimeError as exc:
        # Expected when capture_end ended it before failing, or when
        # capture_begin failed before beginning it.
        if "not currently recording" not in str(exc):
            _note(failure, "ending the allocator's routing", exc)
    except Exception as exc:
        _note(failure, "ending the allocator's routing", exc)
    if began or routed:
        _attempt(failure, "releasing the graph's pool", lambda: api.release(device, pool))
    _attempt(failure, "taking the generator out of capture mode", api.reset_generator)


def _attempt(failure: BaseException, what: str, step: Callable[[], None]) -> None:
    try:
        step()
    except Exception as exc:
        _note(failure, what, exc)


def _note(failure: BaseException, what: str, exc: BaseException) -> None:
    first = (str(exc).strip().splitlines() or [""])[0]
    annotate(
        failure, f"while undoing the failed capture, {what} raised {type(exc).__name__}: {first}"
    )


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


@contextmanager
def restored(stage: nn.Module) -> Iterator[None]:
    """Puts back on exit what warm-up and capture may change: the stage's
    buffers, its deferred BatchNorm counters, the random number generators."""
    buffers = [(b, b.detach().clone()) for b in stage.buffers()]
    counters = [(n, n.tracked, n.hold) for n in stage.modules() if isinstance(n, DeferredBatchNorm)]
    for n, _, _ in counters:
        n.hold = True  # a commit must not be captured: each replay would run it
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        # Through .data, which leaves the version counter alone: capture
        # put back is no change, and an earlier micro-batch's forward may
        # have saved a buffer for its pending backward (BatchNorm saves its
        # running statistics), whose version check would fail.
        for b, saved in buffers:
            b.data.copy_(saved)
        for n, tracked, hold in counters:
            n.tracked, n.hold = tracked, hold
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

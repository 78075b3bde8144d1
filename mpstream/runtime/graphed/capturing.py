"""Capturing a stage call safely: the stage put back, a failed capture
undone, the graph kept as long as its stream's others.

**The stage put back** (:func:`restored`). Warm-up and capture run the
stage, which changes it: BatchNorm updates its running statistics, a
:class:`~mpstream.memory.batchnorm.DeferredBatchNorm` counts the
micro-batch, dropout draws from the generators. None of that is a call the
user made, so it is all put back once capture ends, succeeded or not.

**The random state's order** is :mod:`.rng`'s: captures and the replays
that draw take turns per device before torch 2.13.

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

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
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


@contextmanager
def restored(stage: nn.Module) -> Iterator[None]:
    """Puts back on exit what warm-up and capture may change: the stage's
    buffers, its deferred BatchNorm counters, the random number generators."""
    buffers = [(b, b.detach().clone()) for b in stage.buffers()]
    counters = [
        (n, n.tracked, n.calls, n.hold) for n in stage.modules() if isinstance(n, DeferredBatchNorm)
    ]
    for n, _, _, _ in counters:
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
        for n, tracked, calls, hold in counters:
            n.tracked, n.calls, n.hold = tracked, calls, hold
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

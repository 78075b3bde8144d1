"""One CUDA graph's capture, and all of it undone when the capture fails.

A stage whose capture fails (a host sync such as ``.item()`` invalidates
it) runs eagerly from then on, so the failure must leave torch as it found
it. ``CUDAGraph`` does not see to that (as of torch 2.11,
``aten/src/ATen/cuda/CUDAGraph.cpp``): ``capture_begin`` puts the device's
default generator in capture mode, routes the caching allocator's
allocations on the capturing stream to the graph's pool (taking a use of
the pool) and begins the stream capture; on an invalidated capture,
``capture_end`` raises at ``cudaStreamEndCapture``, before it ends the
routing (``endAllocateToPool``) and before the generator's capture
epilogue, and the graph's destructor releases the pool only after a capture
that ended. Left so, the allocator believes a capture is still underway
(``torch.cuda.empty_cache`` fails an internal assertion; frees deferred by
``record_stream`` are never processed) and the generator stays in capture
mode (an eager dropout raises).

:func:`capturing` undoes it, in this order:

1. the stream capture is ended, if the body raised while it was underway
   (``capture_end``, whose error then only repeats the body's failure);
2. unless the graph did end its capture (its ``pool()`` answers), the graph
   is kept alive for good (torch's pinned-memory allocator still holds a
   routing filter that reads it, and Python offers no call to end that
   one), the caching allocator's routing to the pool is ended and the
   pool's use released (a use is taken once the routing began);
3. the generator is taken out of capture mode by one trivial capture that
   ends properly (torch has no other way; setting another generator state
   would leave earlier graphs advancing the old one).

The exception that propagates is the original one. A cleanup step's error
that is expected (a routing already ended) is dropped; any other is added
to the original as a note. The torch calls are :class:`TorchCapture`'s, so
that tests give a fake and check the order without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from ..errors import annotate

__all__ = ["Graph", "CaptureApi", "TorchCapture", "capturing"]


class Graph(Protocol):
    """What :func:`capturing` needs of a graph (``torch.cuda.CUDAGraph``)."""

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None: ...

    def capture_end(self) -> None: ...

    def pool(self) -> Any: ...


#: Graphs whose capture failed (see the module's step 2).
_kept: list[Graph] = []


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

    def reset_generator(self) -> None:
        """Takes the default generator out of capture mode."""


class TorchCapture:
    """:class:`CaptureApi` on torch's own calls (present from torch 2.8)."""

    def device(self) -> int:
        return torch.cuda.current_device()

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def end_routing(self, device: int, pool: Any) -> None:
        torch._C._cuda_endAllocateToPool(device, pool)

    def release(self, device: int, pool: Any) -> None:
        torch._C._cuda_releasePool(device, pool)

    def keep(self, graph: Graph) -> None:
        _kept.append(graph)  # one per stage that fell back, at most

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
            del graph, scratch  # its own pool goes with it
        current.wait_stream(side)


@contextmanager
def capturing(
    graph: Graph, pool: Any, api: CaptureApi | None = None, mode: str = "thread_local"
) -> Iterator[None]:
    """Captures what runs inside into ``graph``, allocating from ``pool``, on
    the current stream; a failure is undone as the module says.

    Args:
        graph: the graph to capture into.
        pool: the memory pool's handle (``torch.cuda.graph_pool_handle()``,
            or another graph's ``pool()`` to share it).
        api: the torch calls (a fake in tests).
        mode: CUDA's capture mode: ``thread_local`` (another thread's calls
            are allowed) or ``relaxed`` (this thread's too: for captures
            open side by side, whose beginnings and ends make calls that a
            thread-local capture forbids).
    """
    api = api or TorchCapture()
    device = api.device()
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
        return  # it ended: the graph releases its pool; the generator left capture mode
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

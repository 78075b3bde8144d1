"""A step captured as one CUDA graph per segment, ordered by external events.

One graph cannot hold a pipeline step whose groups of stages should
overlap: a graph only waits on work launched before it, and within a step
activations go forward while gradients come back. So the step is cut into
segments (:func:`~mpstream.schedules.segments.segment`) and
:class:`GraphEdges` captures each one as a graph of its own, on its group's
*launch stream*. What a segment reads from an earlier one is ordered by an
external event (``torch.cuda.Event(external=True)``): the producer's graph
holds a record node, the reader's a wait node, so at replay two groups'
graphs run side by side and meet only where data crosses.

Around the segments, on the stream the step is captured from (``main``):

- the *prologue*: what the step issues before its first task (zeroing the
  gradients), captured from :meth:`GraphEdges.begin_step` until the first
  segment opens;
- the *epilogue*: what it issues after the last segment (the loss sum, the
  optimizer step), captured from the end of the run to
  :meth:`GraphEdges.end_step`.

A replay launches the prologue on ``main``; every launch stream waits on
``main``; the segments launch in order, each on its group's stream; ``main``
waits on every launch stream and launches the epilogue. That is
``segments + 2`` graph launches per step.

A capture that fails is undone as graphed stages undo theirs
(:func:`~mpstream.runtime.graphed.capturing.capturing`: the stream capture
ended, the allocator's routing to the pool ended and the pool released, the
generator out of capture mode), and the failure that caused it propagates.

Each graph gets a private memory pool. Segments cannot share one: a block
that one group's graph frees may still be read by another group's graph
running beside it, and a later capture in the same pool would reuse it.

What groups can be captured this way (no tensor shared across groups,
random numbers drawn in one group at most) is :mod:`.groups`' to check.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from ..runtime.graphed.capturing import CaptureApi, capturing
from ..runtime.stream import AnyStream

__all__ = ["Cuda", "GraphEdges", "check_external_events"]


def check_external_events() -> None:
    """Refuses a torch without external CUDA events, before any capture.

    Raises:
        RuntimeError: ``torch.cuda.Event`` takes no ``external`` argument.
    """
    if "external" not in inspect.signature(torch.cuda.Event.__new__).parameters:
        raise RuntimeError(
            f"capturing a step in segments needs torch.cuda.Event(external=True), which "
            f"torch {torch.__version__} does not have; upgrade torch, or capture one graph "
            f"(groups=None)"
        )


@dataclass(frozen=True)
class Cuda:
    """The CUDA objects :class:`GraphEdges` makes, how it makes a stream
    current, and the calls that undo a failed capture: PyTorch's by default;
    a test passes fakes that log."""

    stream: Callable[[torch.device], Any] = field(default=torch.cuda.Stream)
    graph: Callable[[], Any] = field(default=torch.cuda.CUDAGraph)
    event: Callable[[], Any] = field(default=partial(torch.cuda.Event, external=True))
    use: Callable[[Any], AbstractContextManager[Any]] = field(default=torch.cuda.stream)
    pool: Callable[[], Any] = field(default=torch.cuda.graph_pool_handle)
    undo: CaptureApi | None = None  # None: torch's own calls


@dataclass
class _Capture:
    """The capture now open: what it is (prologue, segment, epilogue), its
    graph, stream and group, and the context that ends it (or undoes it)."""

    what: str
    graph: Any
    stream: Any
    group: int
    undo: ExitStack


class GraphEdges:
    """Edges that capture every segment of a step, and replay the step.

    Use: :meth:`begin_step` on ``main`` (the current stream), run the step's
    work with the pipe segmented on these edges (``pipe.segmented(groups,
    edges)``), then :meth:`end_step`; after that, :meth:`replay` runs the
    step again. On a failure, :meth:`abandon` ends whatever capture is open.

    Args:
        main: the stream the step is captured from; it must be current
            while the step is captured.
        cuda: what makes streams, graphs and events (tests pass fakes).
    """

    def __init__(self, main: Any, cuda: Cuda | None = None) -> None:
        self.cuda = cuda if cuda is not None else Cuda()
        self.main = main
        #: One launch stream per group, made when its first segment opens.
        self.launch: dict[int, Any] = {}
        #: (group, graph) of every segment, in launch order.
        self.segments: list[tuple[int, Any]] = []
        self.prologue: Any = None
        self.epilogue: Any = None
        #: Each producer task's external event.
        self.events: dict[int, Any] = {}
        #: The device every segment is captured on (the first one's).
        self.device: torch.device | None = None
        self._open: _Capture | None = None

    # -- capture -----------------------------------------------------------
    @property
    def complete(self) -> bool:
        """Whether a whole step was captured (then :meth:`replay` works)."""
        return self.epilogue is not None and self._open is None

    @property
    def launches(self) -> int:
        """Graph launches per replayed step: the segments, prologue and epilogue."""
        return len(self.segments) + 2

    def begin_step(self) -> None:
        """Starts capturing the step's prologue on ``main``.

        Raises:
            RuntimeError: a step was captured already, or a capture is open.
        """
        if self.prologue is not None or self._open is not None:
            raise RuntimeError("GraphEdges capture one step; make new edges for another")
        self._begin("prologue", self.main, -1)

    def end_step(self) -> None:
        """Ends the epilogue's capture: the step is complete.

        Raises:
            RuntimeError: the epilogue is not being captured (the run did
                not finish, or ran without these edges).
        """
        if self._open is None or self._open.what != "epilogue":
            now = "nothing" if self._open is None else f"the {self._open.what}"
            raise RuntimeError(
                f"end_step() while capturing {now}: the step's run must finish with the "
                f"pipe segmented on these edges first"
            )
        self.epilogue = self._end()

    def open(self, segment: int, group: int, device: torch.device) -> AnyStream | None:
        if self._open is not None and self._open.what == "prologue":
            self.prologue = self._end()
        if self._open is not None or self.prologue is None:
            raise RuntimeError(
                f"segment {segment} opened outside a step's capture (call begin_step() first, "
                f"with no other capture open)"
            )
        if segment != len(self.segments):
            raise RuntimeError(f"segment {segment} opened after {len(self.segments)} segments")
        if self.device is None:
            self.device = device
        elif device != self.device:
            # A copy to another device would join a capture there, whose
            # allocator routes nothing to this step's pools.
            raise RuntimeError(
                f"segment {segment} is on {device}, the step's earlier segments on "
                f"{self.device}: GraphEdges capture the segments of one device"
            )
        stream = self.launch.get(group)
        if stream is None:
            stream = self.launch[group] = self.cuda.stream(device)
        self._begin("segment", stream, group)
        # A CPU group has no stream in the scheduler (its caller slot is a
        # placeholder); its launch stream exists only here.
        return stream if device.type == "cuda" else None

    def close(self, segment: int) -> None:
        if self._open is None or self._open.what != "segment":
            raise RuntimeError(f"close({segment}) without an open segment")
        group = self._open.group
        self.segments.append((group, self._end()))

    def record(self, task: int, stream: AnyStream | None) -> None:
        event = self.events.get(task)
        if event is None:
            event = self.events[task] = self.cuda.event()
        # PyTorch makes an event record external only while the *current*
        # stream captures; between tasks the current stream is main's.
        with self.cuda.use(self._capturing()):
            event.record(stream)

    def wait(self, task: int, stream: AnyStream | None) -> None:
        event = self.events.get(task)
        if event is None:
            raise RuntimeError(f"external wait on task {task}, which recorded no event")
        with self.cuda.use(self._capturing()):
            event.wait(stream)

    def done(self) -> None:
        if self._open is not None:
            raise RuntimeError(f"the run ended with the {self._open.what} still open")
        self._begin("epilogue", self.main, -1)

    def abandon(self) -> None:
        """Ends the open capture, if any, undoing it, and discards what was
        captured. Called while handling the failure, which then carries
        notes of anything the undoing could not do."""
        if self._open is not None:
            stream, undo = self._open.stream, self._open.undo
            self._open = None
            failure = sys.exc_info()[1] or RuntimeError("the step's capture was abandoned")
            with self.cuda.use(stream):
                # Runs the failure path: re-raises nothing but a new error.
                undo.__exit__(type(failure), failure, failure.__traceback__)
        self.segments.clear()
        self.prologue = self.epilogue = None

    # -- replay --------------------------------------------------------------
    def replay(self) -> None:
        """Replays the step after what was issued on ``main`` so far; work
        issued on ``main`` afterwards follows the whole step.

        Raises:
            RuntimeError: no complete step was captured.
        """
        if not self.complete:
            raise RuntimeError("no complete step was captured (see GraphEdges.begin_step)")
        use, main = self.cuda.use, self.main
        with use(main):
            self.prologue.replay()
        for stream in self.launch.values():
            stream.wait_stream(main)
        for group, graph in self.segments:
            with use(self.launch[group]):
                graph.replay()
        for stream in self.launch.values():
            main.wait_stream(stream)
        with use(main):
            self.epilogue.replay()

    # -- helpers -------------------------------------------------------------
    def _begin(self, what: str, stream: Any, group: int) -> None:
        graph, undo = self.cuda.graph(), ExitStack()
        with self.cuda.use(stream):
            # A private pool each (see the module's docstring); thread-local,
            # so another thread's CUDA calls (a pinning DataLoader) are allowed.
            undo.enter_context(capturing(graph, self.cuda.pool(), self.cuda.undo))
        self._open = _Capture(what, graph, stream, group, undo)

    def _end(self) -> Any:
        assert self._open is not None
        graph, stream, undo = self._open.graph, self._open.stream, self._open.undo
        self._open = None
        with self.cuda.use(stream), warnings.catch_warnings():
            # A prologue may hold no work (no zeroing): its replay is empty.
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty")
            undo.close()  # capture_end; undone if it fails
        return graph

    def _capturing(self) -> Any:
        if self._open is None or self._open.what != "segment":
            raise RuntimeError("an external event outside a segment's capture")
        return self._open.stream

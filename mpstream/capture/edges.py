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

Around the segments, on each device's stream the step is captured from
(its ``main``), one graph per device, captured side by side:

- the *prologue*: what the step issues before its first task (zeroing the
  gradients), captured from :meth:`GraphEdges.begin_step` until the first
  segment opens;
- the *epilogue*: what it issues after the last segment (the loss sum, the
  optimizer step), captured from the end of the run to
  :meth:`GraphEdges.end_step`.

A replay launches each device's prologue on its ``main``; every launch
stream waits on every ``main``; the segments launch in order, each on its
group's stream; every ``main`` waits on every launch stream and launches its
epilogue. That is ``segments + 2 x devices`` graph launches per step, and
the ordering around them uses events made once, at capture.

Segments of several devices need nothing more: a segmented run uses one
device's streams per segment and pulls copies between devices into the
receiver's segment (:mod:`~mpstream.runtime.peer`), and an external event
recorded on one device can be waited on by another's graph.

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
from collections.abc import Callable, Mapping
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
    #: An ordinary event, to order the streams around a replay.
    marker: Callable[[], Any] = field(default=torch.cuda.Event)
    use: Callable[[Any], AbstractContextManager[Any]] = field(default=torch.cuda.stream)
    pool: Callable[[], Any] = field(default=torch.cuda.graph_pool_handle)
    undo: CaptureApi | None = None  # None: torch's own calls


@dataclass
class _Capture:
    """A capture now open: what it is (prologue, segment, epilogue), its
    graph, stream, group and device, and the context that ends it (or
    undoes it)."""

    what: str
    graph: Any
    stream: Any
    group: int
    device: torch.device
    undo: ExitStack


class GraphEdges:
    """Edges that capture every segment of a step, and replay the step.

    Use: :meth:`begin_step` with each device's ``main`` stream current, run
    the step's work with the pipe segmented on these edges
    (``pipe.segmented(groups, edges)``), then :meth:`end_step`; after that,
    :meth:`replay` runs the step again. On a failure, :meth:`abandon` ends
    whatever capture is open.

    Args:
        mains: per device, the stream the step is captured from; it must be
            that device's current stream while the step is captured.
        cuda: what makes streams, graphs and events (tests pass fakes).
    """

    def __init__(self, mains: Mapping[torch.device, Any], cuda: Cuda | None = None) -> None:
        if not mains:
            raise ValueError("GraphEdges needs the main stream of at least one device")
        self.cuda = cuda if cuda is not None else Cuda()
        self.mains = dict(mains)
        #: One launch stream per group, made when its first segment opens.
        self.launch: dict[int, Any] = {}
        #: (group, graph) of every segment, in launch order.
        self.segments: list[tuple[int, Any]] = []
        #: Per device, its prologue and epilogue graphs.
        self.prologue: dict[torch.device, Any] = {}
        self.epilogue: dict[torch.device, Any] = {}
        #: Each producer task's external event.
        self.events: dict[int, Any] = {}
        self._open: list[_Capture] = []
        self._ready: dict[torch.device, Any] = {}  # replay: each main's prologue
        self._finished: dict[int, Any] = {}  # replay: each launch stream's segments

    # -- capture -----------------------------------------------------------
    @property
    def complete(self) -> bool:
        """Whether a whole step was captured (then :meth:`replay` works)."""
        return bool(self.epilogue) and not self._open

    @property
    def launches(self) -> int:
        """Graph launches per replayed step: the segments, and a prologue and
        an epilogue per device."""
        return len(self.segments) + 2 * len(self.mains)

    def begin_step(self) -> None:
        """Starts capturing the step's prologue on every device's ``main``.

        Raises:
            RuntimeError: a step was captured already, or a capture is open.
        """
        if self.prologue or self._open:
            raise RuntimeError("GraphEdges capture one step; make new edges for another")
        self._begin_all("prologue")

    def end_step(self) -> None:
        """Ends the epilogues' captures: the step is complete.

        Raises:
            RuntimeError: the epilogue is not being captured (the run did
                not finish, or ran without these edges).
        """
        what = self._what()
        if what != "epilogue":
            now = "nothing" if what is None else f"the {what}"
            raise RuntimeError(
                f"end_step() while capturing {now}: the step's run must finish with the "
                f"pipe segmented on these edges first"
            )
        self.epilogue = self._end_all()
        self._markers()

    def open(self, segment: int, group: int, device: torch.device) -> AnyStream | None:
        if self._what() == "prologue":
            self.prologue = self._end_all()
        if self._open or not self.prologue:
            raise RuntimeError(
                f"segment {segment} opened outside a step's capture (call begin_step() first, "
                f"with no other capture open)"
            )
        if segment != len(self.segments):
            raise RuntimeError(f"segment {segment} opened after {len(self.segments)} segments")
        if device not in self.mains:
            raise RuntimeError(
                f"segment {segment} is on {device}, but the step is captured from "
                f"{', '.join(map(str, self.mains))}: give GraphEdges a main stream there"
            )
        stream = self.launch.get(group)
        if stream is None:
            stream = self.launch[group] = self.cuda.stream(device)
        self._open.append(self._begin("segment", stream, group, device))
        # A CPU group has no stream in the scheduler (its caller slot is a
        # placeholder); its launch stream exists only here.
        return stream if device.type == "cuda" else None

    def close(self, segment: int) -> None:
        if self._what() != "segment":
            raise RuntimeError(f"close({segment}) without an open segment")
        group = self._open[0].group
        (graph,) = self._end_all().values()
        self.segments.append((group, graph))

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
        if self._open:
            raise RuntimeError(f"the run ended with the {self._what()} still open")
        self._begin_all("epilogue")

    def abandon(self) -> None:
        """Ends the open captures, if any, undoing them, and discards what
        was captured. Called while handling the failure, which then carries
        notes of anything the undoing could not do."""
        failure = sys.exc_info()[1] or RuntimeError("the step's capture was abandoned")
        while self._open:
            c = self._open.pop()
            with self.cuda.use(c.stream):
                # Runs the failure path: re-raises nothing but a new error.
                c.undo.__exit__(type(failure), failure, failure.__traceback__)
        self.segments.clear()
        self.prologue, self.epilogue = {}, {}

    # -- replay --------------------------------------------------------------
    def replay(self) -> None:
        """Replays the step after what was issued on each ``main`` so far;
        work issued on a ``main`` afterwards follows the whole step.

        Raises:
            RuntimeError: no complete step was captured.
        """
        if not self.complete:
            raise RuntimeError("no complete step was captured (see GraphEdges.begin_step)")
        use = self.cuda.use
        for device, main in self.mains.items():
            with use(main):
                self.prologue[device].replay()
            self._ready[device].record(main)
        # Across devices too: a segment may read what another device's
        # previous step left in its pool, and the epilogues update weights
        # that every device's graphs read.
        for stream in self.launch.values():
            for ready in self._ready.values():
                stream.wait_event(ready)
        for group, graph in self.segments:
            with use(self.launch[group]):
                graph.replay()
        for group, stream in self.launch.items():
            self._finished[group].record(stream)
        for device, main in self.mains.items():
            for finished in self._finished.values():
                main.wait_event(finished)
            with use(main):
                self.epilogue[device].replay()

    # -- helpers -------------------------------------------------------------
    def _what(self) -> str | None:
        return self._open[0].what if self._open else None

    def _begin_all(self, what: str) -> None:
        # Captures open side by side on several devices: a second one's start
        # (the generator's and allocator's setup on its device) and the
        # first one's end (instantiation) are calls a thread-local capture
        # forbids its own thread.
        mode = "relaxed" if len(self.mains) > 1 else "thread_local"
        for device, main in self.mains.items():
            self._open.append(self._begin(what, main, -1, device, mode))

    def _begin(
        self, what: str, stream: Any, group: int, device: torch.device, mode: str = "thread_local"
    ) -> _Capture:
        graph, undo = self.cuda.graph(), ExitStack()
        with self.cuda.use(stream):
            # A private pool each (see the module's docstring); thread-local
            # where it can be, so another thread's CUDA calls (a pinning
            # DataLoader) are allowed.
            undo.enter_context(capturing(graph, self.cuda.pool(), self.cuda.undo, mode))
        return _Capture(what, graph, stream, group, device, undo)

    def _end_all(self) -> dict[torch.device, Any]:
        """Ends the open captures, in order; a failure undoes the rest."""
        graphs: dict[torch.device, Any] = {}
        while self._open:
            c = self._open[0]
            with self.cuda.use(c.stream), warnings.catch_warnings():
                # A prologue may hold no work (no zeroing): its replay is empty.
                warnings.filterwarnings("ignore", message=".*CUDA Graph is empty")
                self._open.pop(0)
                try:
                    c.undo.close()  # capture_end; undone if it fails
                except BaseException:
                    self.abandon()
                    raise
            graphs[c.device] = c.graph
        return graphs

    def _markers(self) -> None:
        self._ready = {d: self.cuda.marker() for d in self.mains}
        self._finished = {g: self.cuda.marker() for g in self.launch}

    def _capturing(self) -> Any:
        if self._what() != "segment":
            raise RuntimeError("an external event outside a segment's capture")
        return self._open[0].stream

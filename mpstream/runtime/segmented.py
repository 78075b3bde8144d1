"""A training step issued segment by segment, each segment one graph to capture.

A whole step captured across devices (or across groups of stages on one
device) is one CUDA graph per segment of
:func:`~mpstream.schedules.segments.segment`, launched in order. The run is
the ordinary one (:func:`~mpstream.runtime.training.run`, through the one run
loop of :mod:`~mpstream.runtime.executor`) over the segmented order;
:class:`SegmentedIssue` is its issuer (an
:class:`~mpstream.runtime.executor.Issuer`, like the C++ scheduler) and adds
what capture needs at the segments' edges:

- where a segment starts, its :class:`Edges` open a capture on the group's
  stream, and the scheduler starts a segment on it (a source of its own);
- where it ends, the scheduler joins every stream the segment used into
  that stream (a capture must end joined) and the edges close the capture;
- a task reading what an earlier segment produced cannot wait on that
  graph's internal event: the producer's segment records an external event
  after it, and the reader's segment waits on it (the scheduler lists those
  waits and logs both ends, so :func:`~mpstream.runtime.plan.verify_plan`
  checks them);
- a segment uses the streams of one device only, so that each device's
  graphs can be captured there: a copy between devices runs on the
  receiving side (it *pulls*, :mod:`.peer`), issued in the segment of its
  first reader (:func:`issue_order`);
- once the last segment has closed, the edges learn that the run is done:
  what the caller issues next (the loss sum, an optimizer step) follows
  every segment, which a capture orders at replay.

:class:`HostEdges` captures nothing and needs no events: on the CPU, for
the plan alone, or on a GPU, where each segment then starts from the
caller's stream after the previous one's join. The CUDA edges live with
the capture (:mod:`mpstream.capture.edges`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

import torch

from ..schedules.orders import format_order
from ..schedules.schedule import Kind, Schedule, Task
from ..schedules.segments import Segments, action_of, segment
from .scheduler import EventScheduler
from .stream import AnyStream

__all__ = [
    "Edges",
    "HostEdges",
    "SegmentedIssue",
    "Segmenting",
    "issue_order",
    "segment_devices",
]


class Edges(Protocol):
    """What happens at the segments' edges: captures and external events."""

    def open(self, segment: int, group: int, device: torch.device) -> AnyStream | None:
        """Starts segment ``segment`` of ``group`` (whose stages are on
        ``device``); returns the stream to capture it on (None: a
        placeholder)."""
        ...

    def close(self, segment: int) -> None:
        """Ends the open segment (after the scheduler joined it)."""
        ...

    def record(self, task: int, stream: AnyStream | None) -> None:
        """Records task ``task``'s external event on ``stream``."""
        ...

    def wait(self, task: int, stream: AnyStream | None) -> None:
        """Makes ``stream`` wait on task ``task``'s external event."""
        ...

    def done(self) -> None:
        """The run's last segment has closed; the caller's next work follows
        all of them."""
        ...

    def abandon(self) -> None:
        """Ends a capture left open by a failed run, discarding it."""
        ...


class HostEdges:
    """Edges where nothing is captured: the segments run as issued."""

    def open(self, segment: int, group: int, device: torch.device) -> AnyStream | None:
        return None

    def close(self, segment: int) -> None:
        pass

    def record(self, task: int, stream: AnyStream | None) -> None:
        pass

    def wait(self, task: int, stream: AnyStream | None) -> None:
        pass

    def done(self) -> None:
        pass

    def abandon(self) -> None:
        pass


def segment_devices(cut: Segments, devices: Sequence[torch.device]) -> list[torch.device]:
    """The device of each segment: its group's stages'."""
    return [devices[part.actions[0].stage] for part in cut.parts]


def _receiver(task: Task) -> int:
    """The stage whose device a non-compute task's value lands on."""
    return task.stage if task.kind in (Kind.COPY_GRAD, Kind.TARGET) else task.peer


def issue_order(
    schedule: Schedule, cut: Segments, devices: Sequence[torch.device]
) -> tuple[list[int], list[int]]:
    """The order a segmented run issues ``schedule``'s tasks in, and the
    segment of each task.

    A compute task belongs to its own segment. A copy or transfer belongs
    to the segment of the compute task issued before it (the builder issues
    a copy right after the task that produced the value), unless the value
    lands on another device than that segment's: then it moves to just
    before its first reader, into the reader's segment, so that a segment
    only uses streams of its own device (a copy between devices is pulled
    by the receiver: :mod:`.peer`).

    Args:
        schedule: a schedule in ``cut``'s order.
        cut: its segments.
        devices: each stage's device.

    Returns:
        Task indices in issue order, and per task index its segment.

    Raises:
        ValueError: ``schedule`` is not in ``cut``'s order.
    """
    where = {a: i for i, part in enumerate(cut.parts) for a in part.actions}
    device_of = segment_devices(cut, devices)
    tasks = schedule.tasks
    segment_of = [0] * len(tasks)
    order: list[int] = []
    held: set[int] = set()  # tasks waiting for their first reader
    current = 0
    for t in tasks:
        act = action_of(t)
        if act is not None:
            seg = where.get(act)
            if seg is None or seg < current:
                raise ValueError(
                    f"the schedule is not in the segments' order (task {t.index}: "
                    f"{t.kind.label} of stage {t.stage}, micro-batch {t.micro}); build it "
                    f"from Segments.order"
                )
            current = seg
            for d in sorted(held.intersection(t.deps)):
                held.remove(d)
                segment_of[d] = seg
                order.append(d)
        elif devices[_receiver(t)] != device_of[current]:
            held.add(t.index)
            continue
        segment_of[t.index] = current
        order.append(t.index)
    if held:  # read by no compute task: cannot happen in a built schedule
        raise ValueError(f"tasks {sorted(held)} move values that no task reads")
    return order, segment_of


class SegmentedIssue:
    """Issues a run's tasks segment by segment, for the C++ scheduler's caller.

    An :class:`~mpstream.runtime.executor.Issuer` (``begin_run``, ``begin``,
    ``end``, ``join``) with its own order (``tasks``) and ``abort``: the
    executor's ``Segmented``, so a training step runs through it unchanged.

    Args:
        sched: the pipe's scheduler.
        schedule: the step's schedule, in ``cut``'s order.
        cut: its segments.
        edges: captures and external events at the segments' edges.
    """

    def __init__(
        self, sched: EventScheduler, schedule: Schedule, cut: Segments, edges: Edges
    ) -> None:
        self.sched, self.edges, self.cut = sched, edges, cut
        order, self.segment_of = issue_order(schedule, cut, sched.devices)
        #: The tasks in the order they are issued.
        self.tasks = [schedule.tasks[i] for i in order]
        # Tasks a later segment of another group reads: each records an
        # external event. A group's own segments follow each other on its
        # launch stream, which orders what passes between them.
        group = [part.group for part in cut.parts]
        self.producers = frozenset(
            d
            for t in schedule.tasks
            for d in t.deps
            if group[self.segment_of[d]] != group[self.segment_of[t.index]]
        )
        # The caller slot of each segment: its group's device's.
        self.devices = segment_devices(cut, sched.devices)
        self.current = -1
        self.handles: dict[int, int] = {}
        self._last: torch.cuda.Stream | None = None  # the last segment's, without captures

    def begin_run(self, schedule: object, callers: list[int | None]) -> None:
        # Copies between devices are pulled (see issue_order and .peer).
        self.sched.native.begin_run(schedule, callers, pull=True)
        self.current = -1
        self._last = None

    def begin(self, task: int) -> int:
        seg = self.segment_of[task]
        if seg != self.current:
            if self.current >= 0:
                self._close()
            device = self.devices[seg]
            stream = self.edges.open(seg, self.cut.parts[seg].group, device)
            if self.sched.virtual:
                stream = None  # a scheduler without streams (edges tested on the host)
            elif stream is None and device.type == "cuda":
                # Edges that capture nothing, on a GPU: every segment starts
                # from the caller's stream of its device, after the previous
                # segment's join, which orders what crosses segments without
                # events (across devices, through one wait on that stream).
                stream = torch.cuda.current_stream(device)
                last = self._last
                if last is not None and last.device != device:
                    stream.wait_stream(last)
                self._last = stream
            self.current = seg
            caller = self.sched.caller_devices.index(device)
            self.sched.begin_segment(caller, stream, self.cut.parts[seg].group)
        handle = int(self.sched.native.begin(task))
        for producer, slot in self.sched.take_crossing():
            self.edges.wait(producer, self.sched.slot_stream(slot))
        self.handles[handle] = task
        return handle

    def end(self, handle: int) -> None:
        self.sched.native.end(handle)
        task = self.handles.pop(handle)
        if task in self.producers:
            slot = self.sched.external_record(task)
            self.edges.record(task, self.sched.slot_stream(slot))

    def join(self) -> None:
        if self.current >= 0:
            self._close()
        self.sched.join()
        self.edges.done()

    def abort(self, failure: BaseException | None = None) -> None:
        # The scheduler first joins every stream the failed segment used
        # into its capturing stream, so that its capture ends as a capture
        # (an unjoined one fails to end). The edges may hold a capture open
        # outside any segment too (a step's prologue): they always hear.
        self.handles.clear()
        self.current = -1
        try:
            self.sched.abort(failure)
        finally:
            self.edges.abandon()

    def _close(self) -> None:
        self.sched.end_segment()
        self.edges.close(self.current)
        self.current = -1


class Segmenting:
    """Makes a pipe's training steps run segment by segment.

    While set on a pipe (:meth:`mpstream.Pipe.segmented`), each
    ``train_step`` runs its schedule reordered into segments of ``groups``
    and issued through :class:`SegmentedIssue` with ``edges``.

    Args:
        groups: a group label per stage; None: by device.
        edges: captures and external events at the segments' edges.
    """

    def __init__(self, groups: Sequence[int] | None, edges: Edges) -> None:
        self.groups = None if groups is None else list(groups)
        self.edges = edges
        self._orders: dict[int, tuple[Schedule, Schedule, Segments]] = {}

    def issue(self, sched: EventScheduler, schedule: Schedule) -> tuple[Schedule, SegmentedIssue]:
        """``schedule`` in segment order, and what issues it.

        Raises:
            ValueError: ``groups`` does not hold one label per stage, or puts
                stages of two devices in one group; stages on both the CPU
                and CUDA (segments exist to be captured as CUDA graphs).
        """
        kept = self._orders.get(id(schedule))
        if kept is None or kept[0] is not schedule:
            kinds = sorted({d.type for d in sched.devices})
            if len(kinds) > 1:
                raise ValueError(
                    f"a step in segments runs on one kind of device (its segments are CUDA "
                    f"graphs, or the same steps on the CPU); this pipe's stages are on "
                    f"{' and '.join(kinds)}"
                )
            groups = self.groups
            if groups is not None:
                for s, t in itertools.combinations(range(len(groups)), 2):
                    if groups[s] == groups[t] and sched.devices[s] != sched.devices[t]:
                        raise ValueError(
                            f"groups puts stages {s} ({sched.devices[s]}) and {t} "
                            f"({sched.devices[t]}) in one group: a group is captured as "
                            f"one graph, on one device"
                        )
            cut = segment(schedule, groups)
            ordered = Schedule(
                format_order(cut.order),
                schedule.stages,
                schedule.micros,
                schedule.topology,
                copy_target=schedule.copy_target,
            )
            kept = (schedule, ordered, cut)
            self._orders[id(schedule)] = kept
        _, ordered, cut = kept
        return ordered, SegmentedIssue(sched, ordered, cut, self.edges)

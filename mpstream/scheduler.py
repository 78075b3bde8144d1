"""Typed wrapper over the C++ event scheduler.

:class:`EventScheduler` owns one compute stream and one copy stream per stage
and hands them to ``mpstream._C.Scheduler``, which makes each task's stream
wait on the events of the tasks it depends on, records its completion event
from a per-device pool, and can log every stream operation (the plan) and
time every task.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from . import _ext
from .schedule import Schedule
from .stream import AnyStream, current_stream, device_type_code, new_stream, stream_id
from .timeline import Span

__all__ = ["EventScheduler", "PlanOp"]

_C = _ext.load()


class PlanOp(NamedTuple):
    """One stream operation as issued (or, virtually, as it would be).

    ``op`` is ``'wait'`` (``slot`` waits on ``event``), ``'record'``
    (``event`` recorded on ``slot``), ``'run'`` (the task's work issued on
    ``slot``) or ``'sync'`` (the host blocks on ``event``). ``task`` is the
    index in the schedule, -1 for the run's source/join and for gradient
    copies issued by autograd.
    """

    op: str
    slot: int
    event: int
    task: int
    kind: str
    stage: int
    micro: int


class EventScheduler:
    """Streams and event scheduling for a pipeline's stages.

    Args:
        devices: the device of each stage.
        virtual: schedule without touching any device: every stream is a
            placeholder and only the plan is produced (recording mode).
    """

    def __init__(self, devices: Sequence[torch.device], *, virtual: bool = False) -> None:
        self.devices = [torch.device(d) for d in devices]
        self.virtual = virtual
        callers: list[torch.device] = []
        for d in self.devices:
            if d not in callers:
                callers.append(d)
        self.caller_devices = callers

        def stream(d: torch.device) -> AnyStream | None:
            return None if virtual else new_stream(d)

        self.compute_streams = [stream(d) for d in self.devices]
        self.copy_streams = [stream(d) for d in self.devices]
        stage_slots = []
        self.slot_names: list[str] = []
        for s, d in enumerate(self.devices):
            for role, st in (("compute", self.compute_streams[s]), ("copy", self.copy_streams[s])):
                name = f"stage{s}.{role}@{d}"
                self.slot_names.append(name)
                stage_slots.append(self._spec(d, st, name))
        caller_slots = []
        for d in callers:
            name = f"caller@{d}"
            self.slot_names.append(name)
            caller = None if virtual else current_stream(d)
            caller_slots.append(self._spec(d, caller, name))
        caller_of_stage = [callers.index(d) for d in self.devices]
        self.slot_devices = [d for d in self.devices for _ in range(2)] + callers
        self.native: Any = _C.Scheduler(stage_slots, caller_slots, caller_of_stage)

    @staticmethod
    def _spec(device: torch.device, stream: AnyStream | None, name: str) -> Any:
        index = -1 if device.index is None else device.index
        sid = None if stream is None else stream_id(stream)
        return _C.SlotSpec(device_type_code(device), index, sid, name)

    def caller_streams(self) -> list[int | None]:
        """The calling thread's current stream id on each caller device."""
        if self.virtual:
            return [None] * len(self.caller_devices)
        return [stream_id(current_stream(d)) for d in self.caller_devices]

    def begin_run(self, schedule: Schedule) -> None:
        """Starts a run; source events are recorded on the caller's streams."""
        self.native.begin_run(schedule.native, self.caller_streams())

    def begin(self, task: int) -> int:
        """Issues the waits of ``task`` and makes its streams current."""
        return int(self.native.begin(task))

    def end(self, handle: int) -> None:
        """Records the task's completion event and restores the streams."""
        self.native.end(handle)

    def join(self) -> None:
        """Makes the caller's streams wait on the run and ends it."""
        self.native.join()

    def abort(self) -> None:
        """Ends a failed run: restores streams and releases its events."""
        self.native.abort()

    def begin_grad_copy(self, stage: int, micro: int) -> int:
        """Opens an autograd-issued gradient copy from ``stage + 1`` to ``stage``."""
        return int(self.native.begin_grad_copy(stage, micro))

    @property
    def recording(self) -> bool:
        return bool(self.native.recording)

    @recording.setter
    def recording(self, on: bool) -> None:
        self.native.recording = on

    def plan(self) -> list[PlanOp]:
        """Every stream operation logged while recording was on."""
        return [PlanOp(*op) for op in self.native.plan()]

    def clear_plan(self) -> None:
        self.native.clear_plan()

    @property
    def timing(self) -> bool:
        return bool(self.native.timing)

    @timing.setter
    def timing(self, on: bool) -> None:
        self.native.timing = on

    def timings(self) -> list[Span]:
        """Per-task start/end times; blocks until the timed work is done.

        Times are milliseconds from the timing reference; ``run`` counts the
        runs (forwards or training steps) since the timings were cleared,
        from 1, and autograd's backward belongs to the run whose forward
        built its graph.
        """
        return [
            Span(s, m, kind, self.slot_names[slot], start, end, run)
            for s, m, kind, slot, start, end, run in self.native.timings()
        ]

    def clear_timings(self) -> None:
        self.native.clear_timings()

    @property
    def events_created(self) -> int:
        return int(self.native.events_created)

    @property
    def events_free(self) -> int:
        return int(self.native.events_free)

"""Typed wrapper over the C++ event scheduler.

:class:`EventScheduler` owns one compute stream and one copy stream per stage
and one io stream per device (transfers from the host) and hands them to
``mpstream._C.Scheduler``, which makes each task's stream wait on the events
of the tasks it depends on, records its completion event from a per-device
pool, and can log every stream operation (the plan) and time every task.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from .. import _ext
from .._warn import warn
from ..schedules.schedule import Schedule
from .callers import CallerStreams
from .errors import annotate
from .stream import (
    AnyStream,
    as_device,
    current_stream,
    device_type_code,
    is_cuda,
    new_stream,
    stream_id,
)

__all__ = [
    "EventScheduler",
    "PlanOp",
    "TaskTime",
    "StreamAliasWarning",
    "AUTOGRAD_ORDERS_GRAD_COPIES",
    "COMPUTE_PRIORITY",
]

_C = _ext.load()

# Since torch 2.8 (pytorch/pytorch#151079), autograd's engine makes a node's
# stream wait on the streams that produced its incoming gradients right
# before the node runs (torch/csrc/autograd/engine.cpp, Engine::
# evaluate_function, "Ensure that the incoming gradients are ready"). A
# gradient copy's consumer is then ordered after the copy on its own device's
# thread, at the right point in its stream. Earlier versions only synchronize
# the consumer with its device's default stream when the producer node sits
# on another device (torch/csrc/autograd/input_buffer.cpp, InputBuffer::add,
# case 3), so the scheduler must issue the wait itself.
AUTOGRAD_ORDERS_GRAD_COPIES: bool = torch.__version__ >= (2, 8)  # type: ignore[operator]


# CUDA stream priority of the stages' compute streams (lower is higher);
# copy and io streams keep the default, 0.
COMPUTE_PRIORITY = -1


class StreamAliasWarning(RuntimeWarning):
    """Two pipeline streams are the same CUDA stream: their work serialises."""


class TaskTime(NamedTuple):
    """When one task ran, as the scheduler timed it (milliseconds)."""

    stage: int
    micro: int
    kind: str
    stream: str
    start_ms: float
    end_ms: float
    run: int
    peer: int = -1
    issue_ms: float = 0.0  # host time spent issuing the task (between its begin and end)


def device_failure(devices: Sequence[torch.device]) -> str | None:
    """How the first of ``devices`` that fails a synchronize fails (None: none does)."""
    for d in devices:
        if d.type != "cuda":
            continue
        try:
            torch.cuda.synchronize(d)
        except Exception as exc:  # a CUDA error surfaces as RuntimeError or AcceleratorError
            return f"{d} still fails ({(str(exc).strip().splitlines() or [''])[0]})"
    return None


# Schedulers whose streams are alive, to spot streams shared between pipes.
_LIVE: weakref.WeakSet[EventScheduler] = weakref.WeakSet()
# Guards adding to _LIVE against another thread's walk over it (a pipe's
# first call in each of two threads): a set that grows while it is iterated
# raises RuntimeError.
_LIVE_LOCK = threading.Lock()
_warned_across_pipes = False


class PlanOp(NamedTuple):
    """One stream operation as issued (or, virtually, as it would be).

    ``op`` is ``'wait'`` (``slot`` waits on ``event``), ``'record'``
    (``event`` recorded on ``slot``), ``'run'`` (the task's work issued on
    ``slot``), ``'sync'`` (the host blocks on ``event``) or ``'autograd'``
    (autograd's engine makes ``slot`` wait on ``event`` before a gradient
    copy's consumer runs; logged, not issued). ``task`` is the index in the
    schedule, -1 for the run's source/join and for gradient copies issued by
    autograd. ``peer`` is the receiving stage of a copy (see
    :class:`~mpstream.schedules.schedule.Task`).
    """

    op: str
    slot: int
    event: int
    task: int
    kind: str
    stage: int
    micro: int
    peer: int = -1


class EventScheduler:
    """Streams and event scheduling for a pipeline's stages.

    Args:
        devices: the device of each stage.
        virtual: schedule without touching any device: every stream is a
            placeholder and only the plan is produced (recording mode).

    Raises:
        ValueError: an entry of ``devices`` is not a device.
    """

    def __init__(self, devices: Sequence[torch.device], *, virtual: bool = False) -> None:
        self.devices = [as_device(d, f"devices[{i}]") for i, d in enumerate(devices)]
        self.virtual = virtual
        callers: list[torch.device] = []
        for d in self.devices:
            if d not in callers:
                callers.append(d)
        self.caller_devices = callers

        def stream(d: torch.device, priority: int = 0) -> AnyStream | None:
            return None if virtual else new_stream(d, priority)

        # Compute runs at high priority. A copy within one GPU is a kernel
        # whose grid fills every SM; without priorities a stage's kernels
        # queued after it wait until its last block is dispatched, so the
        # copy serialises with compute instead of overlapping it (on an
        # H100 the forced-copy training probe overlapped 0.65 without
        # priorities, 0.94 with them; docs/results/h100).
        self.compute_streams = [stream(d, COMPUTE_PRIORITY) for d in self.devices]
        self.copy_streams = [stream(d) for d in self.devices]
        self.io_streams = [stream(d) for d in callers]
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
        io_slots = []
        for d, st in zip(callers, self.io_streams):
            name = f"io@{d}"
            self.slot_names.append(name)
            io_slots.append(self._spec(d, st, name))
        caller_of_stage = [callers.index(d) for d in self.devices]
        self.slot_devices = [d for d in self.devices for _ in range(2)] + callers + callers
        self.native: Any = _C.Scheduler(stage_slots, caller_slots, caller_of_stage, io_slots)
        self.native.autograd_orders_grad_copies = AUTOGRAD_ORDERS_GRAD_COPIES
        #: The streams the pipe's latest call was made from: a call from
        #: another one waits on them first (:meth:`CallerStreams.follow`).
        self.callers = CallerStreams([] if virtual else callers)
        #: A device error met ending a failed run (:meth:`abort`), until
        #: :meth:`check_device` finds the devices working again.
        self.device_error: str | None = None
        if not virtual:
            self._check_aliasing()
            with _LIVE_LOCK:
                _LIVE.add(self)

    def named_streams(self) -> Iterator[tuple[str, AnyStream]]:
        """The pipeline's own streams (compute, copy, io) with their slot names."""
        per_stage = [st for pair in zip(self.compute_streams, self.copy_streams) for st in pair]
        for name, st in zip(self.slot_names[: len(per_stage)], per_stage):
            if st is not None:
                yield name, st
        io_names = self.slot_names[-len(self.io_streams) :]
        for name, st in zip(io_names, self.io_streams):
            if st is not None:
                yield name, st

    def _check_aliasing(self) -> None:
        # torch.cuda.Stream() hands out a fixed pool of streams per device
        # round-robin (32 per priority), so many stages on one GPU, or many
        # live pipes, end up sharing streams: correct, but serialised.
        global _warned_across_pipes
        owners: dict[tuple[int, int], list[str]] = defaultdict(list)
        for name, st in self.named_streams():
            if is_cuda(st):
                owners[(st.device.index, stream_id(st) or 0)].append(name)
        shared = [names for names in owners.values() if len(names) > 1]
        if shared:
            pairs = "; ".join(" = ".join(names) for names in shared)
            warn(
                f"mpstream: these pipeline streams are one and the same CUDA stream, so their "
                f"work serialises (results stay correct): {pairs}. PyTorch hands out "
                f"{len(owners)} distinct pooled streams here; put fewer stages on one device.",
                StreamAliasWarning,
            )
        if _warned_across_pipes:
            return
        with _LIVE_LOCK:
            others = list(_LIVE)
        for other in others:
            clashes = [
                f"{name} (another live Pipe's)"
                for name, st in other.named_streams()
                if is_cuda(st) and (st.device.index, stream_id(st) or 0) in owners
            ]
            if clashes:
                _warned_across_pipes = True
                warn(
                    "mpstream: this Pipe's streams are shared with another live Pipe: "
                    f"{', '.join(clashes[:4])}. PyTorch's stream pool is exhausted; work "
                    f"on shared streams serialises. Delete pipes you no longer use. "
                    f"(Warned once per process.)",
                    StreamAliasWarning,
                )
                return

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

    def abort(self, failure: BaseException | None = None) -> None:
        """Ends a failed run: restores streams and releases its events.

        Args:
            failure: what made the run fail. An error met while ending the
                run (a device error: CUDA's are sticky) is added to it as a
                note rather than raised in its place; a device error is also
                kept, for the next call's :meth:`check_device`.

        Raises:
            RuntimeError: ending the run met an error and there is no
                ``failure`` to add it to.
        """
        try:
            self.native.abort()
        except Exception as exc:
            said = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
            if "abort() ran on another thread" not in str(exc):
                self.device_error = said
            if failure is None:
                raise
            annotate(failure, f"mpstream: ending the failed run raised too: {said}")

    @contextmanager
    def captured(self) -> Iterator[None]:
        """Says to the C++ scheduler that a CUDA graph captures its streams
        while inside (c10 cannot tell it): it then refuses what a graph
        cannot hold, a host wait on device work and timing."""
        self.native.capturing = True
        try:
            yield
        finally:
            self.native.capturing = False

    def start_call(self) -> None:
        """Called as a call of the pipe (``pipe(x)``, ``train_step``) starts,
        before it issues anything: :meth:`check_device`, then the call's
        streams wait on the previous caller's (:meth:`CallerStreams.follow`).
        The check comes first: on a device left broken, those waits would
        raise CUDA's own error, which says nothing of the earlier failure.

        Raises:
            RuntimeError: a device still fails (see :meth:`check_device`).
        """
        self.check_device()
        self.callers.follow()

    def check_device(self) -> None:
        """As a call starts (:meth:`start_call`), after :meth:`abort` met a
        device error: whether the devices work again (a synchronize each);
        if they do, the error is forgotten.

        Raises:
            RuntimeError: a device still fails; CUDA errors such as an
                illegal memory access are sticky, and only a new process
                recovers.
        """
        if self.device_error is None:
            return
        broken = device_failure(self.caller_devices)
        if broken is not None:
            raise RuntimeError(
                f"an earlier call of this pipe failed and ending it raised {self.device_error}; "
                f"{broken}: the error is sticky (the CUDA context is lost), so no call can run "
                f"in this process: restart it, and find the first failure (CUDA_LAUNCH_BLOCKING=1 "
                f"names the kernel)"
            )
        self.device_error = None

    def begin_grad_copy(self, stage: int, peer: int, micro: int) -> int:
        """Opens an autograd-issued gradient copy from ``peer``'s device to ``stage``."""
        return int(self.native.begin_grad_copy(stage, peer, micro))

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

    def timings(self) -> list[TaskTime]:
        """Per-task start/end times; blocks until the timed work is done.

        Times are milliseconds from the timing reference; ``run`` counts the
        runs (forwards or training steps) since the timings were cleared,
        from 1, and autograd's backward belongs to the run whose forward
        built its graph. A run that failed (:meth:`abort`) leaves none: its
        number is skipped.
        """
        return [
            TaskTime(s, m, kind, self.slot_names[slot], start, end, run, peer, issue)
            for s, m, kind, slot, start, end, run, peer, issue in self.native.timings()
        ]

    def clear_timings(self) -> None:
        self.native.clear_timings()

    @property
    def events_created(self) -> int:
        return int(self.native.events_created)

    @property
    def events_free(self) -> int:
        return int(self.native.events_free)

    @property
    def timing_events_created(self) -> int:
        return int(self.native.timing_events_created)

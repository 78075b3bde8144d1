"""Executes a schedule's tasks on the stage streams.

One host thread walks the task list in order. For every task the scheduler
first makes the task's stream wait on the events it depends on and makes that
stream current; the task's work is then enqueued (a stage's forward, a
:class:`~mpstream.copy.Copy`, a host transfer), and the scheduler records its
completion event. Kernels and copies are asynchronous and nothing here waits
for the device, so the walk runs ahead of the device and the streams
overlap. If anything raises, the run is aborted (the caller's streams ordered
after everything queued, streams restored, events released) before the
exception propagates, and no later task starts; the exception carries a note
saying which task of which stage and micro-batch raised it
(:mod:`~mpstream.errors`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor, nn
from torch.autograd import profiler

from . import marks
from .boundary import GradSink, cut
from .checkpoint import checkpointed
from .copy import Copy, Route, move
from .errors import annotate, raised_in, task_note
from .microbatch import Value, check_output, rebuild, tensors_of
from .schedule import Kind, Schedule, Task
from .scheduler import EventScheduler
from .stream import AnyStream, current_stream, is_cuda, record_stream
from .transfer import GradLink, HostWait, to_device

# Pinned staging buffers of one micro-batch, one entry per tensor (see
# mpstream.transfer.host_staging), or None when nothing needs staging.
Staging = tuple[Tensor | None, ...] | None

__all__ = ["Worker", "range_name"]


def range_name(kind: Kind, stage: int, micro: int) -> str:
    """The ``record_function`` name of a task: kind, stage and micro-batch."""
    return f"mpstream/{kind.label}/stage{stage}/mb{micro}"


def _range(profiling: bool, kind: Kind, stage: int, micro: int) -> AbstractContextManager[object]:
    if profiling:
        return profiler.record_function(range_name(kind, stage, micro))
    return nullcontext()


def _cuda_only(streams: Sequence[AnyStream | None]) -> list[AnyStream | None]:
    """The streams record_stream applies to: CUDA ones; None for the rest."""
    return [s if s is not None and is_cuda(s) else None for s in streams]


def _protect(value: Value, stream: AnyStream | None) -> None:
    if stream is not None:
        for t in tensors_of(value):
            record_stream(t, stream)


class Worker:
    """Runs forward schedules over a pipeline's partitions.

    Args:
        partitions: one module per stage.
        sched: the event scheduler owning the stage streams.
        force_copies: copy between stages even on the same device.
        labels: how error notes name each stage (default ``stage s of n``).
    """

    def __init__(
        self,
        partitions: Sequence[nn.Module],
        sched: EventScheduler,
        force_copies: bool = False,
        labels: Sequence[str] | None = None,
    ) -> None:
        self.partitions = list(partitions)
        self.sched = sched
        self.force_copies = force_copies
        n = len(self.partitions)
        self.labels = list(labels) if labels else [f"stage {s} of {n}" for s in range(n)]

    def _annotate(self, exc: BaseException, task: Task | None, micros: int) -> None:
        # Only errors: an interrupt is not the task's fault.
        if task is not None and isinstance(exc, Exception):
            in_loss = task.kind is Kind.FORWARD and raised_in(exc, _loss.__code__)
            annotate(exc, task_note(task, micros, self.labels, in_loss))

    def forward(
        self,
        batches: list[Value],
        schedule: Schedule,
        checkpoint_stop: int = 0,
        staging: Sequence[Staging] | None = None,
    ) -> list[Value]:
        """Runs every task of ``schedule`` over the micro-batches.

        Args:
            batches: micro-batches on the input device.
            schedule: a forward schedule for this pipeline.
            checkpoint_stop: micro-batches below this index are checkpointed.
            staging: per micro-batch, pinned buffers for its input transfer.

        Returns:
            The last stage's output per micro-batch, ready on the caller's
            current stream of the last device.
        """
        sched = self.sched
        native = sched.native  # the hot loop calls the C++ scheduler directly
        parts = self.partitions
        last = len(parts) - 1
        # record_stream is only needed (and only valid) for CUDA streams.
        readers = _cuda_only(sched.compute_streams)
        (caller_reader,) = _cuda_only([current_stream(sched.devices[last])])
        copy_in = schedule.copy_in
        force = self.force_copies
        host_grads = torch.is_grad_enabled() and sched.devices[0].type == "cuda"
        profiling = torch._C._autograd._profiler_enabled()
        # While timing, mark where autograd will run each stage's backward.
        marking = native.timing and torch.is_grad_enabled()
        values = list(batches)
        task: Task | None = None
        native.begin_run(schedule.native, sched.caller_streams())
        try:
            for task in schedule.tasks:
                s, m = task.stage, task.micro
                if task.kind is Kind.FORWARD:
                    x = values[m]
                    handle = native.begin(task.index)
                    if readers[s] is not None and not copy_in[s]:
                        # Read on this stage's stream, allocated on another.
                        # Inside the task, so record_stream itself is issued
                        # on the stream that reads.
                        _protect(x, readers[s])
                    stage = parts[s]
                    if marking:
                        x, stage_marks = marks.enter(native, s, m, x)
                    if profiling:
                        with profiler.record_function(range_name(task.kind, s, m)):
                            y = checkpointed(stage, x) if m < checkpoint_stop else stage(x)
                    else:
                        y = checkpointed(stage, x) if m < checkpoint_stop else stage(x)
                    if type(y) is not Tensor:
                        y = check_output(y, s)
                    if marking:
                        y = marks.leave(stage_marks, y)
                    native.end(handle)
                    values[m] = y
                elif task.kind is Kind.COPY:
                    value = values[m]
                    handle = native.begin(task.index)
                    tensors = tensors_of(value)
                    if s < 0:
                        route = Route(sched, s, m, staging=staging[m] if staging else None)
                        if host_grads and any(t.requires_grad and not t.is_cuda for t in tensors):
                            # The input's gradient comes back asynchronously;
                            # the host consumer waits for it (transfer.py).
                            route.link = GradLink()
                            tensors = HostWait.apply(route.link, *tensors)
                    else:
                        route = Route(sched, s, m, force)
                    if profiling:
                        with profiler.record_function(range_name(task.kind, s, m)):
                            moved = Copy.apply(route, *tensors)
                    else:
                        moved = Copy.apply(route, *tensors)
                    native.end(handle)
                    values[m] = rebuild(value, moved)
                else:
                    raise RuntimeError(f"forward schedules have no {task.kind.label} tasks")
            task = None
            native.join()
        except BaseException as exc:
            native.abort()
            self._annotate(exc, task, len(batches))
            raise
        if caller_reader is not None:
            # The outputs were allocated on the last stage's stream; after the
            # join the caller's stream reads them.
            for value in values:
                _protect(value, caller_reader)
        return values

    def train(
        self,
        batches: list[Value],
        targets: list[Value],
        schedule: Schedule,
        loss_fn: Callable[[Value, Value], Tensor],
        weights: Sequence[float],
        checkpoint_stop: int = 0,
        staging: Sequence[Staging] | None = None,
        target_staging: Sequence[Staging] | None = None,
        before_backward: Callable[[int], None] | None = None,
        scale: Callable[[Tensor], Tensor] | None = None,
    ) -> list[Tensor]:
        """Runs forward and backward of every micro-batch in ``schedule``'s order.

        The graph is cut at every stage input (:mod:`~mpstream.boundary`), so
        each stage's backward is its own task; gradients of stage inputs
        travel back as explicit gradient-copy tasks. Parameter gradients
        accumulate through autograd as usual.

        Args:
            batches: input micro-batches.
            targets: target micro-batches; unless on the last stage's device,
                the schedule has a target task per micro-batch that moves it.
            schedule: a schedule with backward tasks (``gpipe`` or ``1f1b``).
            loss_fn: ``loss_fn(output, target)`` returning a scalar.
            weights: factor of each micro-batch's loss.
            checkpoint_stop: micro-batches below this index are checkpointed.
            staging: per micro-batch, pinned buffers for its input transfer.
            target_staging: per micro-batch, pinned buffers for its target.
            before_backward: called with a stage's index inside its first
                backward task, on its stream, before any gradient of the step
                accumulates into its parameters.
            scale: applied to each weighted loss, inside the last stage's
                forward task, before its backward (``GradScaler.scale``); the
                returned losses stay unscaled.

        Returns:
            The weighted loss of each micro-batch (detached), ready on the
            caller's current stream of the last device.

        Raises:
            TypeError: a stage returned a non-tensor, or ``loss_fn`` did not
                return a scalar tensor.
        """
        sched = self.sched
        native = sched.native
        parts = self.partitions
        last = len(parts) - 1
        devices = sched.devices
        readers = _cuda_only(sched.compute_streams)
        copiers = _cuda_only(sched.copy_streams)
        (caller_reader,) = _cuda_only([current_stream(devices[last])])
        copy_in = schedule.copy_in
        force = self.force_copies
        profiling = torch._C._autograd._profiler_enabled()
        values: list[Value | None] = list(batches)
        labels = list(targets)
        backward_seen: set[int] = set()
        roots: dict[tuple[int, int], tuple[Tensor, ...]] = {}
        sinks: dict[tuple[int, int], GradSink] = {}
        grads: dict[int, tuple[Tensor | None, ...]] = {}
        losses: list[Tensor] = []
        task: Task | None = None
        native.begin_run(schedule.native, sched.caller_streams())
        try:
            for task in schedule.tasks:
                kind, s, m = task.kind, task.stage, task.micro
                # Everything a task issues, record_stream and the boundary
                # cut included, happens between begin and end: on the task's
                # streams, so autograd nodes and the allocator see them there.
                if kind is Kind.FORWARD:
                    x = values[m]
                    assert x is not None
                    handle = native.begin(task.index)
                    if readers[s] is not None and not copy_in[s]:
                        _protect(x, readers[s])
                    if s > 0:
                        sinks[(s, m)] = sink = GradSink()
                        x = rebuild(x, cut(sink, tensors_of(x)))
                    with _range(profiling, kind, s, m):
                        stage = parts[s]
                        y = checkpointed(stage, x) if m < checkpoint_stop else stage(x)
                        y = check_output(y, s)
                        if s == last:
                            loss = _loss(loss_fn, y, labels[m], readers[s], weights[m])
                            roots[(s, m)] = (loss if scale is None else scale(loss),)
                            losses.append(loss.detach())
                            del loss
                    native.end(handle)
                    if s < last:
                        roots[(s, m)] = tensors_of(y)
                    values[m] = y if s < last else None
                    # Locals must not keep a finished micro-batch's graph
                    # alive: 1F1B's memory bound counts on it.
                    del x, y
                elif kind is Kind.COPY:
                    value = values[m]
                    assert value is not None
                    dst = devices[s + 1]
                    handle = native.begin(task.index)
                    with _range(profiling, kind, s, m), torch.no_grad():
                        if s < 0:
                            moved_value = _transfer(value, dst, staging[m] if staging else None)
                        else:
                            moved = [move(t, dst, force=force) for t in tensors_of(value)]
                            moved_value = rebuild(value, moved)
                    if s >= 0:
                        _protect(value, copiers[s])
                    _protect(moved_value, readers[s + 1])
                    native.end(handle)
                    values[m] = moved_value
                elif kind is Kind.TARGET:
                    handle = native.begin(task.index)
                    with _range(profiling, kind, s, m), torch.no_grad():
                        buffers = target_staging[m] if target_staging else None
                        labels[m] = _transfer(labels[m], devices[last], buffers)
                    _protect(labels[m], readers[last])
                    native.end(handle)
                elif kind is Kind.BACKWARD:
                    handle = native.begin(task.index)
                    if before_backward is not None and s not in backward_seen:
                        backward_seen.add(s)
                        before_backward(s)
                    with _range(profiling, kind, s, m):
                        _backward(roots.pop((s, m)), None if s == last else grads.pop(m))
                    if s > 0:
                        captured = sinks.pop((s, m)).grads or ()
                        grads[m] = captured
                        if not copy_in[s]:
                            _protect_all(captured, readers[s - 1])
                    native.end(handle)
                elif kind is Kind.COPY_GRAD:
                    # Gradient of stage s + 1's input, back to stage s.
                    outgoing = grads[m]
                    handle = native.begin(task.index)
                    with _range(profiling, kind, s, m), torch.no_grad():
                        moved_grads = tuple(
                            None if g is None else move(g, devices[s], force=force)
                            for g in outgoing
                        )
                    _protect_all(outgoing, copiers[s + 1])
                    _protect_all(moved_grads, readers[s])
                    native.end(handle)
                    grads[m] = moved_grads
            task = None
            native.join()
        except BaseException as exc:
            native.abort()
            self._annotate(exc, task, len(batches))
            raise
        if caller_reader is not None:
            for loss in losses:
                record_stream(loss, caller_reader)
        return losses


def _backward(roots: tuple[Tensor, ...], grads: tuple[Tensor | None, ...] | None) -> None:
    """One stage's backward; its references die with this frame."""
    if grads is None:
        torch.autograd.backward(roots)
        return
    pairs = [(t, g) for t, g in zip(roots, grads) if g is not None and t.requires_grad]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def _protect_all(tensors: Sequence[Tensor | None], stream: AnyStream | None) -> None:
    if stream is not None:
        for t in tensors:
            if t is not None:
                record_stream(t, stream)


def _transfer(value: Value, device: torch.device, staging: Staging) -> Value:
    """Moves a micro-batch (or its target) from the host or the caller's device."""
    buffers = staging or (None,) * len(tensors_of(value))
    return rebuild(value, [to_device(t, device, b) for t, b in zip(tensors_of(value), buffers)])


def _loss(
    loss_fn: Callable[[Value, Value], Tensor],
    output: Value,
    target: Value,
    reader: AnyStream | None,
    weight: float,
) -> Tensor:
    """The weighted loss of one micro-batch, on the last stage's stream.

    ``target`` sits on the last stage's device: moved there by its target
    task, or put there by the caller (then allocated on the caller's stream).
    """
    if reader is not None:
        _protect(target, reader)
    return _scalar(loss_fn(output, target)) * weight


def _scalar(loss: object) -> Tensor:
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        what = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, Tensor)
            else type(loss).__name__
        )
        raise TypeError(f"loss_fn must return a scalar tensor, got {what}")
    return loss.reshape(())

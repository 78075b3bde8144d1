"""Executes a schedule's tasks on the stage streams.

One host thread walks the task list in order. For every task the scheduler
first makes the task's stream wait on the events it depends on and makes that
stream current; the task's work is then enqueued (a stage's forward, or a
:class:`~mpstream.copy.Copy`), and the scheduler records its completion event.
Kernels are asynchronous, so the walk runs ahead of the device and the
streams overlap. If anything raises, the run is aborted (streams restored,
events released) before the exception propagates, and no later task starts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.autograd import profiler

from .copy import Copy
from .microbatch import Value, check_output
from .schedule import Kind, Schedule
from .scheduler import EventScheduler
from .stream import AnyStream, current_stream, is_cuda, record_stream

__all__ = ["Worker", "range_name"]


def range_name(kind: Kind, stage: int, micro: int) -> str:
    """The ``record_function`` name of a task: kind, stage and micro-batch."""
    return f"mpstream/{kind.label}/stage{stage}/mb{micro}"


def _tensors(value: Value) -> tuple[Tensor, ...]:
    return (value,) if isinstance(value, Tensor) else value


def _protect(value: Value, stream: AnyStream | None) -> None:
    if stream is not None:
        for t in _tensors(value):
            record_stream(t, stream)


class Worker:
    """Runs forward schedules over a pipeline's partitions.

    Args:
        partitions: one module per stage.
        sched: the event scheduler owning the stage streams.
    """

    def __init__(self, partitions: Sequence[nn.Module], sched: EventScheduler) -> None:
        self.partitions = list(partitions)
        self.sched = sched

    def forward(self, batches: list[Value], schedule: Schedule) -> list[Value]:
        """Runs every task of ``schedule`` over the micro-batches.

        Args:
            batches: micro-batches on the input device.
            schedule: a forward schedule for this pipeline.

        Returns:
            The last stage's output per micro-batch, ready on the caller's
            current stream of the last device.
        """
        sched = self.sched
        native = sched.native  # the hot loop calls the C++ scheduler directly
        parts = self.partitions
        last = len(parts) - 1
        # record_stream is only needed (and only valid) for CUDA streams.
        readers = [s if s is not None and is_cuda(s) else None for s in sched.compute_streams]
        caller = current_stream(sched.devices[last])
        caller_reader = caller if is_cuda(caller) else None
        copy_in = schedule.copy_in
        profiling = torch._C._autograd._profiler_enabled()
        values = list(batches)
        native.begin_run(schedule.native, sched.caller_streams())
        try:
            for task in schedule.tasks:
                s, m = task.stage, task.micro
                if task.kind is Kind.FORWARD:
                    x = values[m]
                    if readers[s] is not None and not copy_in[s]:
                        # Read on this stage's stream, allocated on another.
                        _protect(x, readers[s])
                    handle = native.begin(task.index)
                    if profiling:
                        with profiler.record_function(range_name(task.kind, s, m)):
                            y = parts[s](x)
                    else:
                        y = parts[s](x)
                    native.end(handle)
                    if type(y) is not Tensor:
                        y = check_output(y, s)
                    values[m] = y
                    if s == last and caller_reader is not None:
                        _protect(y, caller_reader)
                elif task.kind is Kind.COPY:
                    value = values[m]
                    handle = native.begin(task.index)
                    if profiling:
                        with profiler.record_function(range_name(task.kind, s, m)):
                            moved = Copy.apply(sched, s, m, *_tensors(value))
                    else:
                        moved = Copy.apply(sched, s, m, *_tensors(value))
                    native.end(handle)
                    values[m] = moved[0] if isinstance(value, Tensor) else tuple(moved)
                else:
                    raise RuntimeError(f"forward schedules have no {task.kind.label} tasks")
            native.join()
        except BaseException:
            native.abort()
            raise
        return values

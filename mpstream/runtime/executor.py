"""The one run loop: issues every task of a run on the stage streams.

One host thread walks a schedule's tasks in order. For every task the
scheduler first makes the task's streams wait on the events the task depends
on and makes them current; the task's work is then enqueued, and the
scheduler records its completion event. Kernels and copies are asynchronous
and nothing here waits for the device, so the walk runs ahead of the device
and the streams overlap.

What a task does depends on the run, not on the loop: a forward run
(``pipe(x)``, :mod:`~mpstream.runtime.forward`) has forward and copy tasks,
a training step (:mod:`~mpstream.runtime.training`) adds target, backward,
weight and gradient-copy tasks. Each hands the loop its run
(a :class:`~mpstream.runtime.runs.Run`), which has one handler per kind and
says whether it is a training step.

If anything raises, the run is aborted (the caller's streams ordered after
everything queued, streams restored, events released) before the exception
propagates, and no later task starts; the exception carries a note saying
which task of which stage and micro-batch raised it
(:mod:`~mpstream.runtime.errors`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from types import CodeType
from typing import TYPE_CHECKING

from torch.autograd import profiler

from ..schedules.schedule import Kind, Schedule, Task
from . import private
from .errors import annotate, annotate_task
from .runs import Handler, Handlers, Run

if TYPE_CHECKING:
    from .worker import Worker

__all__ = ["Handler", "Handlers", "execute", "range_name", "task_range"]


def range_name(kind: Kind, stage: int, micro: int) -> str:
    """The ``record_function`` name of a task: kind, stage and micro-batch."""
    return f"mpstream/{kind.label}/stage{stage}/mb{micro}"


def task_range(
    profiling: bool, kind: Kind, stage: int, micro: int
) -> AbstractContextManager[object]:
    """A ``record_function`` range for the task while profiling, else nothing."""
    if profiling:
        return profiler.record_function(range_name(kind, stage, micro))
    return nullcontext()


def execute(
    worker: Worker,
    schedule: Schedule,
    run: Run,
    micros: int,
    *,
    loss: CodeType | None = None,
) -> None:
    """Issues every task of ``schedule``, each through its kind's handler.

    Args:
        worker: the pipeline's stages, scheduler and graphed stages.
        schedule: the run's schedule.
        run: the run's state: its :attr:`~mpstream.runtime.runs.Run.handlers`
            do each kind of task; a training step
            (:attr:`~mpstream.runtime.runs.Run.step`: its graphed stages end
            with the run) or a forward run (they end with autograd's
            backward).
        micros: the number of micro-batches (for error notes).
        loss: the code of the loss computation, to tell ``loss_fn`` errors
            from the stage's in error notes.

    Raises:
        RuntimeError: the schedule has a kind of task the run has no
            handler for.
    """
    sched = worker.sched
    native = sched.native  # the C++ scheduler itself: no wrapper call per task
    graphs = worker.graphs
    handlers, step = run.handlers, run.step
    profiling = private.profiler_enabled()
    task: Task | None = None
    tag = native.run_tag
    try:
        # First: a run re-entered from inside a stage is refused before
        # anything of the run in progress (its graphs' slots) changes.
        native.begin_run(schedule.native, sched.caller_streams())
        if graphs is not None:
            graphs.begin(schedule, step=step)
        for task in schedule.tasks:
            handler = handlers.get(task.kind)
            if handler is None:
                what, other = (
                    ("training steps", "another run")
                    if step
                    else ("forward runs", "a training step")
                )
                raise RuntimeError(
                    f"{what} have no {task.kind.label} tasks: the schedule was built for {other}"
                )
            handle = native.begin(task.index)
            # No context manager unless profiling: this is the hot loop.
            if profiling:
                with task_range(profiling, task.kind, task.stage, task.micro):
                    handler(run, task)
            else:
                handler(run, task)
            native.end(handle)
        task = None
        native.join()
        if step and graphs is not None:
            graphs.end()  # after the join: on the caller's streams
    except BaseException as exc:
        if native.run_tag == tag:
            # begin_run refused (or never began) this run: a run in progress
            # is another call's. Past it, even a Ctrl-C that lands as it
            # returns is this run's to abort, or the pipe stays "running".
            raise
        try:
            sched.abort(exc)
        finally:
            if step and graphs is not None:
                try:
                    graphs.end()
                except Exception as cleanup:  # a sticky device error: exc stays the one raised
                    annotate(exc, f"mpstream: ending the graphed stages raised too: {cleanup!r}")
        annotate_task(exc, task, micros, worker.labels, worker.partitions, loss)
        raise

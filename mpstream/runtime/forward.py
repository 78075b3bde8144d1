"""A forward run's tasks (``pipe(x)``): stage forwards and copies.

Autograd, not the schedule, runs the backward of a forward run: the user
calls ``loss.backward()`` later. So nothing is cut: a stage's forward builds
its autograd graph as usual, and a copy task (where autograd records the
run) is a :class:`~mpstream.runtime.copy.Copy`, whose backward sends the
gradient back on the copy streams. A graphed stage replays inside autograd
(:func:`~mpstream.runtime.replay_autograd.run_stage`). While timing, each stage's
forward is wrapped in marks (:mod:`~mpstream.runtime.marks`) so that
autograd's backward of it is timed too.

Around the run loop, :func:`run` holds the rest of a run's life: deferred
BatchNorm updates once the whole run succeeded, and a run that fails
leaves its graphed stages' calls waiting for no backward (the loop begins
the graphed stages' run, :func:`~mpstream.runtime.executor.execute`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..memory.batchnorm import DeferredBatchNorm, deferred_update
from ..memory.checkpoint import run_eagerly
from ..schedules.schedule import Kind, Schedule, Task
from . import marks
from .executor import execute
from .handoffs import Handoffs
from .hops import send_hop
from .microbatch import leaves, rebuild_leaves
from .replay_autograd import run_stage
from .runs import Run
from .stream import current_stream
from .transfer import Staging
from .values import cuda_only, protect

if TYPE_CHECKING:
    from .worker import Worker

__all__ = ["run"]


class _Forward(Run):
    """The state of one forward run and its task handlers."""

    step = False

    def __init__(
        self,
        worker: Worker,
        batches: Sequence[tuple[Any, ...]],
        schedule: Schedule,
        checkpoint_stop: int,
        staging: Sequence[Staging] | None,
    ) -> None:
        super().__init__(worker, batches, schedule, checkpoint_stop, staging)
        self.native = self.sched.native
        self.grad = torch.is_grad_enabled()
        # What replays hand on, for graphed readers to take in place.
        graphed = self.graphs is not None and self.grad
        self.handoffs = Handoffs(self.routes) if graphed else None
        # While timing, mark where autograd will run each stage's backward.
        self.marking = self.native.timing and self.grad
        self.results: list[Any] = [None] * len(batches)
        # After the join, the caller's stream there reads the outputs.
        (self.caller,) = cuda_only([current_stream(self.sched.devices[self.last])])

    def forward(self, task: Task) -> None:
        s, m = task.stage, task.micro
        flow = self.flow
        args = flow.values(s, m)
        if self.readers[s] is not None and not flow.received[s]:
            # Read on this stage's stream, allocated on another. Inside the
            # task, so record_stream itself is issued on the stream that reads.
            protect(args, self.readers[s])
        stage = self.parts[s]
        if self.marking:
            args, stage_marks = marks.enter(self.native, s, m, args)
        checkpoint = m < self.checkpoint_stop
        if self.graphs is not None:
            # Replayed where it can be (reading handoffs in place), else eager.
            y = run_stage(self.graphs, s, m, stage, args, checkpoint, self.handoffs)
        else:
            y = run_eagerly(stage, args, checkpoint)
        if self.marking:
            y = marks.leave(stage_marks, y)
        out = flow.keep(s, m, y)
        if s == self.last:
            self.results[m] = out

    def copy(self, task: Task) -> None:
        hop = self.routes.by_task[(task.stage, task.peer)]
        send_hop(self.flow, hop, self.sched, task, self.staging, force=self.force, grad=self.grad)

    handlers = {Kind.FORWARD: forward, Kind.COPY: copy}

    def finish(self) -> list[Any]:
        """The outputs, once the run joined the caller's streams."""
        results = self.results
        if self.caller is not None:
            # The outputs were allocated on the last stage's stream.
            protect(results, self.caller)
        if self.graphs is not None and len(results) == 1:
            # One micro-batch's outputs are not concatenated: copied, they no
            # longer are the graphs' buffers, which the next call rewrites.
            results = [_copied(results[0])]
        return results


def run(
    worker: Worker,
    batches: Sequence[tuple[Any, ...]],
    schedule: Schedule,
    checkpoint_stop: int = 0,
    staging: Sequence[Staging] | None = None,
    norms: Sequence[DeferredBatchNorm] = (),
) -> list[Any]:
    """Runs every task of a forward ``schedule`` over the micro-batches.

    Args:
        worker: the pipeline's worker (stages, scheduler, graph).
        batches: per micro-batch, the pipeline's positional inputs.
        schedule: a forward schedule for this pipeline.
        checkpoint_stop: micro-batches below this index are checkpointed.
        staging: per micro-batch, pinned buffers for its input transfers.
        norms: the pipeline's deferred BatchNorm layers: they update once
            the whole run succeeded, else drop what it accumulated
            (:func:`~mpstream.memory.batchnorm.deferred_update`).

    Returns:
        The pipeline's output per micro-batch, on the last stage's device,
        ready on the caller's current stream there.

    A run that raises leaves its graphed stages' calls waiting for no
    backward (:meth:`~mpstream.runtime.graphed.stages.StageGraphs.abandon`).
    """
    graphs = worker.graphs
    runs = 0 if graphs is None else graphs.runs
    try:
        with deferred_update(norms, len(batches)):
            state = _Forward(worker, batches, schedule, checkpoint_stop, staging)
            execute(worker, schedule, state, len(batches))
            return state.finish()
    except BaseException:
        if graphs is not None:
            graphs.abandon(runs)  # the next calls replay, the exception held or not
        raise


def _copied(value: Any) -> Any:
    """``value`` with each tensor copied (on the current stream)."""
    items, spec = leaves(value)
    return rebuild_leaves([x.clone() if isinstance(x, Tensor) else x for x in items], spec)

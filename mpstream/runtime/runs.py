"""What a forward run and a training step hold alike, set up once.

Both kinds of run (:mod:`~mpstream.runtime.forward`'s ``pipe(x)``,
:mod:`~mpstream.runtime.training`'s ``train_step``) borrow the same things
from their :class:`~mpstream.runtime.worker.Worker` and the schedule: the
stage calls for the call's arguments, the hops and the values wired along
them (:class:`~mpstream.runtime.values.Flow`), the graphed stages, the
streams that read each stage's inputs. :class:`Run` sets them up; each
kind adds its own state and handlers, and says what it is, for the run loop
(:func:`~mpstream.runtime.executor.execute`) to read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from ..schedules.schedule import Kind, Schedule, Task
from .stream import AnyStream
from .transfer import Staging
from .values import Flow, cuda_only

if TYPE_CHECKING:
    from .worker import Worker

__all__ = ["Handler", "Handlers", "Run"]

# What a run does for one kind of task (a method of the run's class, called
# with the run and the task), and for each kind it has.
Handler = Callable[[Any, Task], None]
Handlers = Mapping[Kind, Handler]


class Run:
    """The state every run starts from; a subclass adds its handlers.

    Args:
        worker: the pipeline's worker (stages, scheduler, graph).
        batches: per micro-batch, the pipeline's positional inputs.
        schedule: the run's schedule.
        checkpoint_stop: micro-batches below this index are checkpointed.
        staging: per micro-batch, pinned buffers for its input transfers.

    Raises:
        ValueError: ``schedule`` was built for another stage graph.
        TypeError: a micro-batch is not a tuple.
    """

    #: What the run does for each kind of task: methods of the subclass,
    #: which the loop calls with the run (a class's table: nothing is built
    #: per run).
    handlers: ClassVar[Handlers]
    #: A training step (its graphed stages end with the run), not a forward
    #: run (they end with autograd's backward).
    step: ClassVar[bool]

    def __init__(
        self,
        worker: Worker,
        batches: Sequence[tuple[Any, ...]],
        schedule: Schedule,
        checkpoint_stop: int,
        staging: Sequence[Staging] | None,
    ) -> None:
        sched = worker.sched
        self.sched = sched
        self.graphs = worker.graphs
        self.parts = worker.calls(len(batches[0]) if batches else 1)
        self.last = len(self.parts) - 1
        self.routes, wiring = worker.routes(schedule.topology)
        self.flow = Flow(wiring, batches)
        self.staging = staging
        self.checkpoint_stop = checkpoint_stop
        # record_stream is only needed (and only valid) for CUDA streams.
        self.readers: list[AnyStream | None] = cuda_only(sched.compute_streams)
        self.force = schedule.topology.force_copies  # copies between stages on one device too

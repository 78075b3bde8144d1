"""What a forward run and a training step hold alike, set up once.

Both kinds of run (:mod:`~mpstream.runtime.forward`'s ``pipe(x)``,
:mod:`~mpstream.runtime.training`'s ``train_step``) borrow the same things
from their :class:`~mpstream.runtime.worker.Worker` and the schedule: the
stage calls for the call's arguments, the hops and the values wired along
them (:class:`~mpstream.runtime.values.Flow`), the graphed stages, the
streams that read each stage's inputs. :class:`Run` sets them up; each
kind adds its own state and handlers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..schedules.schedule import Schedule
from .stream import AnyStream
from .transfer import Staging
from .values import Flow, cuda_only

if TYPE_CHECKING:
    from .worker import Worker

__all__ = ["Run"]


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

"""The pipeline's stages, as the run loop sees them.

A :class:`Worker` holds what every run of one pipeline shares: its stages
(and their calls), the event scheduler owning their streams, the stage graph
wired on the schedule's devices, the graphed stages, and how error notes
name each stage (the notes themselves: :func:`~mpstream.runtime.errors.annotate_task`).
A run borrows it: :func:`~mpstream.runtime.forward.run` (``pipe(x)``) and
:func:`~mpstream.runtime.training.run` (``train_step``), both issued by the
one run loop (:mod:`~mpstream.runtime.executor`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..schedules.schedule import Topology
from .calls import StageCalls
from .graph import Routes, StageGraph
from .graphed import StageGraphs
from .scheduler import EventScheduler
from .values import Wiring

__all__ = ["Worker"]


class Worker:
    """What every run of one pipeline shares.

    Args:
        partitions: one callable module per stage.
        sched: the event scheduler owning the stage streams.
        graph: where each stage's arguments come from (default: a chain).
        labels: how error notes name each stage (default ``stage s of n``).
        graphs: replays stage calls from CUDA graphs (``Pipe(graphs=True)``);
            None runs every stage eagerly.
    """

    def __init__(
        self,
        partitions: Sequence[nn.Module],
        sched: EventScheduler,
        graph: StageGraph | None = None,
        labels: Sequence[str] | None = None,
        graphs: StageGraphs | None = None,
    ) -> None:
        self.partitions = list(partitions)
        self.graphs = graphs
        self.calls = StageCalls(self.partitions)
        self.sched = sched
        self.graph = graph or StageGraph.chain(len(self.partitions))
        self._routes: dict[Topology, tuple[Routes, Wiring]] = {}
        n = len(self.partitions)
        self.labels = list(labels) if labels else [f"stage {s} of {n}" for s in range(n)]

    def routes(self, topology: Topology) -> tuple[Routes, Wiring]:
        """The hops of this worker's graph for a schedule's topology, and the
        wiring of a run's values along them (cached)."""
        cached = self._routes.get(topology)
        if cached is None:
            routes = Routes(
                self.graph, topology.devices, topology.input_device, topology.force_copies
            )
            if routes.topology != topology:
                raise ValueError("the schedule was built for another stage graph")
            cached = self._routes[topology] = (routes, Wiring(routes))
        return cached

"""Executes a schedule's tasks on the stage streams.

One host thread walks the task list in order. For every task the scheduler
first makes the task's stream wait on the events it depends on and makes that
stream current; the task's work is then enqueued (a stage's forward, a
:class:`~mpstream.runtime.copy.Copy` along a hop of the stage graph, a host
transfer), and the scheduler records its completion event. Kernels and
copies are asynchronous and nothing here waits for the device, so the walk
runs ahead of the device and the streams overlap. If anything raises, the run
is aborted (the caller's streams ordered after everything queued, streams
restored, events released) before the exception propagates, and no later
task starts; the exception carries a note saying which task of which stage
and micro-batch raised it (:mod:`~mpstream.runtime.errors`).
:mod:`~mpstream.runtime.training` runs training steps the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import profiler

from ..memory.checkpoint import checkpointed
from ..schedules.schedule import Kind, Schedule, Task, Topology
from . import marks, private
from .calls import StageCalls
from .copy import Copy, Route
from .errors import annotate, dtype_hint, inplace_hint, raised_in, task_note
from .graph import ALL, Hop, Routes, StageGraph
from .graphed import StageGraphs
from .microbatch import leaves, rebuild_leaves
from .replayed import run_stage
from .scheduler import EventScheduler
from .stream import AnyStream, current_stream, is_cuda, record_stream
from .transfer import GradLink, HostWait
from .values import Flow, Wiring, tensor_leaves

__all__ = [
    "Worker",
    "range_name",
    "Staging",
    "protect",
    "cuda_only",
    "task_range",
    "hop_staging",
    "compute",
]

# Pinned staging buffers of one micro-batch, one entry per leaf of its inputs
# (see mpstream.runtime.transfer.host_staging), or None when nothing needs staging.
Staging = tuple[Tensor | None, ...] | None


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


def cuda_only(streams: Sequence[AnyStream | None]) -> list[AnyStream | None]:
    """The streams record_stream applies to: CUDA ones; None for the rest."""
    return [s if s is not None and is_cuda(s) else None for s in streams]


def protect(values: Sequence[Any], stream: AnyStream | None) -> None:
    """Marks every tensor among ``values`` as used by ``stream``."""
    if stream is not None:
        for t in tensor_leaves(values):
            record_stream(t, stream)


def compute(
    graphs: StageGraphs | None,
    s: int,
    m: int,
    stage: nn.Module,
    args: Sequence[Any],
    checkpoint: bool,
) -> Any:
    """Stage ``s``'s forward of micro-batch ``m``: replayed from its graphs
    when the pipe has them, else eagerly (checkpointed when asked)."""
    if graphs is not None:
        return run_stage(graphs, s, m, stage, args, checkpoint)
    return checkpointed(stage, *args) if checkpoint else stage(*args)


def hop_leaves(values: Sequence[Any]) -> tuple[list[Any], list[Any], list[int]]:
    """Flattens a hop's values: all leaves, their structures, tensor positions."""
    items: list[Any] = []
    specs: list[Any] = []
    for v in values:
        flat, spec = leaves(v)
        items.extend(flat)
        specs.append((spec, len(flat)))
    return items, specs, [i for i, x in enumerate(items) if isinstance(x, Tensor)]


def rebuild_hop(items: Sequence[Any], specs: Sequence[Any]) -> list[Any]:
    """The inverse of :func:`hop_leaves`."""
    out, start = [], 0
    for spec, count in specs:
        out.append(rebuild_leaves(items[start : start + count], spec))
        start += count
    return out


class Worker:
    """Runs schedules over a pipeline's stages.

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

    def annotate(
        self, exc: BaseException, task: Task | None, micros: int, loss: Any = None
    ) -> None:
        """Notes on ``exc`` which task raised it (``loss``: the code of the
        loss computation, to tell ``loss_fn`` errors from the stage's)."""
        # Only errors: an interrupt is not the task's fault.
        if task is not None and isinstance(exc, Exception):
            in_loss = loss is not None and task.kind is Kind.FORWARD and raised_in(exc, loss)
            annotate(exc, task_note(task, micros, self.labels, in_loss))
            hint = inplace_hint(exc, task)
            if hint is None and 0 <= task.stage < len(self.partitions):
                params = self.partitions[task.stage].parameters()
                hint = dtype_hint(exc, task, {p.dtype for p in params})
            if hint is not None:
                annotate(exc, hint)

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

    def forward(
        self,
        batches: Sequence[tuple[Any, ...]],
        schedule: Schedule,
        checkpoint_stop: int = 0,
        staging: Sequence[Staging] | None = None,
    ) -> list[Any]:
        """Runs every task of ``schedule`` over the micro-batches.

        Args:
            batches: per micro-batch, the pipeline's positional inputs.
            schedule: a forward schedule for this pipeline.
            checkpoint_stop: micro-batches below this index are checkpointed.
            staging: per micro-batch, pinned buffers for its input transfers.

        Returns:
            The pipeline's output per micro-batch, on the last stage's device,
            ready on the caller's current stream there.
        """
        sched = self.sched
        native = sched.native  # the hot loop calls the C++ scheduler directly
        parts = self.calls(len(batches[0]) if batches else 1)
        last = len(parts) - 1
        routes, wiring = self.routes(schedule.topology)
        flow = Flow(wiring, batches)
        # record_stream is only needed (and only valid) for CUDA streams.
        readers = cuda_only(sched.compute_streams)
        (caller_reader,) = cuda_only([current_stream(sched.devices[last])])
        force = schedule.topology.force_copies  # copies between stages on one device too
        grad = torch.is_grad_enabled()
        profiling = private.profiler_enabled()
        # While timing, mark where autograd will run each stage's backward.
        marking = native.timing and grad
        results: list[Any] = [None] * len(batches)
        task: Task | None = None
        graphs = self.graphs
        sched.check_device()
        # First: a run re-entered from inside a stage is refused before anything
        # of the run in progress (its graphs' slots) changes.
        native.begin_run(schedule.native, sched.caller_streams())
        try:
            if graphs is not None:
                graphs.begin(schedule, step=False)
            for task in schedule.tasks:
                s, m = task.stage, task.micro
                if task.kind is Kind.FORWARD:
                    handle = native.begin(task.index)
                    args = flow.values(s, m)
                    if readers[s] is not None and not flow.received[s]:
                        # Read on this stage's stream, allocated on another.
                        # Inside the task, so record_stream itself is issued
                        # on the stream that reads.
                        protect(args, readers[s])
                    stage = parts[s]
                    if marking:
                        args, stage_marks = marks.enter(native, s, m, args)
                    # No context manager unless profiling: this is the hot loop.
                    if profiling:
                        with task_range(profiling, task.kind, s, m):
                            y = compute(graphs, s, m, stage, args, m < checkpoint_stop)
                    else:
                        y = compute(graphs, s, m, stage, args, m < checkpoint_stop)
                    if marking:
                        y = marks.leave(stage_marks, y)
                    out = flow.keep(s, m, y)
                    if s == last:
                        results[m] = out
                    native.end(handle)
                    del args, y
                elif task.kind is Kind.COPY:
                    handle = native.begin(task.index)
                    hop = routes.by_task[(s, task.peer)]
                    items, specs, where = hop_leaves(flow.hop_values(hop, m))
                    tensors = [items[i] for i in where]
                    if s < 0:
                        buffers = hop_staging(staging, m, hop, flow.outputs_of(-1, m), where)
                        route = Route(sched, s, task.peer, m, staging=buffers)
                        if (
                            grad
                            and sched.devices[task.peer].type == "cuda"
                            and any(t.requires_grad and not t.is_cuda for t in tensors)
                        ):
                            # The input's gradient comes back asynchronously;
                            # the host consumer waits for it (transfer.py).
                            route.link = GradLink()
                            tensors = list(HostWait.apply(route.link, *tensors))
                    else:
                        route = Route(sched, s, task.peer, m, force=force)
                    with task_range(profiling, task.kind, s, m):
                        moved = Copy.apply(route, *tensors)
                    for i, t in zip(where, moved):
                        items[i] = t
                    flow.put_moved(hop, m, rebuild_hop(items, specs))
                    native.end(handle)
                else:
                    raise RuntimeError(f"forward schedules have no {task.kind.label} tasks")
            task = None
            native.join()
        except BaseException as exc:
            sched.abort(exc)
            self.annotate(exc, task, len(batches))
            raise
        if caller_reader is not None:
            # The outputs were allocated on the last stage's stream; after the
            # join the caller's stream reads them.
            protect(results, caller_reader)
        if graphs is not None and len(results) == 1:
            # One micro-batch's outputs are not concatenated: copied, they no
            # longer are the graphs' buffers, which the next call rewrites.
            results = [_copied(results[0])]
        return results


def _copied(value: Any) -> Any:
    """``value`` with each tensor copied (on the current stream)."""
    items, spec = leaves(value)
    return rebuild_leaves([x.clone() if isinstance(x, Tensor) else x for x in items], spec)


def hop_staging(
    staging: Sequence[Staging] | None,
    m: int,
    hop: Hop,
    inputs: Sequence[Any],
    where: Sequence[int],
) -> Staging:
    """The staging buffers of an input hop's tensors (its leaves at ``where``).

    ``staging[m]`` lines up with the leaves of all of micro-batch ``m``'s
    inputs; the hop moves those of ``hop.indices``.
    """
    if not staging or staging[m] is None:
        return None
    buffers = staging[m]
    assert buffers is not None
    if hop.indices == (ALL,):
        positions: Sequence[int] = range(len(buffers))
    else:
        counts = [len(leaves(x)[0]) for x in inputs]
        starts = [sum(counts[:k]) for k in range(len(counts))]
        positions = [starts[k] + j for k in hop.indices for j in range(counts[k])]
    return tuple(buffers[positions[i]] for i in where)

"""Runs a training step's tasks: forwards, backwards and both kinds of copy.

The autograd graph is cut at every stage's inputs (:mod:`~mpstream.runtime.boundary`),
so each stage's backward is a task of its own, scheduled like its forward.
The gradient of a value a stage read comes out of the cut; when the value
crossed devices it goes back in a gradient-copy task, summed first over the
stages on that device that read it; the producing stage's backward sums what
reached it and back-propagates its outputs. Parameter gradients accumulate
through autograd as usual. Where the schedule splits a backward (a weight
task follows it), the backward task computes the input gradients only and
the weight task the parameter gradients (:mod:`~mpstream.runtime.split_backward`).
A stage replayed from CUDA graphs runs its tasks without autograd, through
:mod:`~mpstream.runtime.replayed`; to the stages around it, it is one more
producer of outputs and consumer of gradients.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..memory.checkpoint import checkpointed
from ..schedules.schedule import Kind, Schedule, Task
from . import private
from .boundary import Cutting, Grads, cut_inputs, roots_of, route_grads, sum_grads
from .copy import move
from .errors import annotate
from .graph import Hop, Ref
from .graphed import StageGraphs
from .microbatch import leaves, rebuild_leaves
from .peer import pull
from .replayed import Replayed
from .segmented import SegmentedIssue
from .split_backward import WeightPass, backward_inputs
from .stream import AnyStream, current_stream, record_stream
from .transfer import to_device
from .values import Flow
from .worker import (
    Staging,
    cuda_only,
    hop_leaves,
    hop_staging,
    protect,
    rebuild_hop,
    task_range,
)

if TYPE_CHECKING:
    from .worker import Worker

__all__ = ["run"]


def _backward(roots: list[tuple[tuple[int, int], Tensor]], grads: Grads | None) -> None:
    """One stage's backward from its outputs' gradients."""
    if grads is None:  # the last stage: the loss
        torch.autograd.backward([t for _, t in roots])
        return
    pairs = [(t, sum_grads(grads[key])) for key, t in roots if key in grads]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def _backward_inputs(
    roots: list[tuple[tuple[int, int], Tensor]], grads: Grads | None
) -> WeightPass:
    """A split backward's first pass (input gradients); returns the second."""
    if grads is None:  # the last stage: the loss
        return backward_inputs([t for _, t in roots], None)
    pairs = [(t, sum_grads(grads[key])) for key, t in roots if key in grads]
    return backward_inputs([t for t, _ in pairs], [g for _, g in pairs])


def _eager(
    graphs: StageGraphs | None, s: int, stage: Any, args: Sequence[Any], checkpoint: bool
) -> Any:
    """Stage ``s``'s forward run eagerly (checkpointed when asked)."""
    if graphs is not None:
        return graphs.eager(s, stage, args, checkpoint)
    return checkpointed(stage, *args) if checkpoint else stage(*args)


def _transfer(value: Any, device: torch.device, staging: Staging) -> Any:
    """Moves a micro-batch's inputs (or its target) from the host or the caller's device."""
    items, spec = leaves(value)
    where = [i for i, t in enumerate(items) if isinstance(t, Tensor)]
    buffers = staging or (None,) * len(where)
    for i, b in zip(where, buffers):
        items[i] = to_device(items[i], device, b)
    return rebuild_leaves(items, spec)


def _loss(
    loss_fn: Callable[[Any, Any], Tensor],
    output: Any,
    target: Any,
    reader: AnyStream | None,
    weight: float,
) -> Tensor:
    """The weighted loss of one micro-batch, on the last stage's stream.

    ``target`` sits on the last stage's device: moved there by its target
    task, or put there by the caller (then allocated on the caller's stream).
    """
    protect([target], reader)
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


def run(
    worker: Worker,
    batches: Sequence[tuple[Any, ...]],
    targets: Sequence[Any],
    schedule: Schedule,
    loss_fn: Callable[[Any, Any], Tensor],
    weights: Sequence[float],
    checkpoint_stop: int = 0,
    staging: Sequence[Staging] | None = None,
    target_staging: Sequence[Staging] | None = None,
    before_backward: Callable[[int], None] | None = None,
    scale: Callable[[Tensor], Tensor] | None = None,
    issue: SegmentedIssue | None = None,
) -> list[Tensor]:
    """Runs forward and backward of every micro-batch in ``schedule``'s order.

    Args:
        worker: the pipeline's worker (stages, scheduler, graph).
        batches: per micro-batch, the pipeline's positional inputs.
        targets: target micro-batches; unless on the last stage's device, the
            schedule has a target task per micro-batch that moves it.
        schedule: a schedule with backward tasks (any but a forward-only
            ``gpipe``).
        loss_fn: ``loss_fn(output, target)`` returning a scalar.
        weights: factor of each micro-batch's loss.
        checkpoint_stop: micro-batches below this index are checkpointed.
        staging: per micro-batch, pinned buffers for its input transfers.
        target_staging: per micro-batch, pinned buffers for its target.
        before_backward: called with a stage's index inside its first
            backward task, on its stream, before any gradient of the step
            accumulates into its parameters.
        scale: applied to each weighted loss, inside the last stage's forward
            task, before its backward (``GradScaler.scale``); the returned
            losses stay unscaled.
        issue: issues the tasks segment by segment (``schedule`` in its
            order), for capture; by default the scheduler issues them.

    Returns:
        The weighted loss of each micro-batch (detached), ready on the
        caller's current stream of the last device.

    Raises:
        TypeError: a stage returned an unsupported value, or ``loss_fn`` did
            not return a scalar tensor.
    """
    sched = worker.sched
    native: Any = sched.native if issue is None else issue
    parts = worker.calls(len(batches[0]) if batches else 1)
    last = len(parts) - 1
    devices = sched.devices
    routes, wiring = worker.routes(schedule.topology)
    flow = Flow(wiring, batches)
    readers = cuda_only(sched.compute_streams)
    copiers = cuda_only(sched.copy_streams)
    (caller_reader,) = cuda_only([current_stream(devices[last])])
    force = schedule.topology.force_copies

    def pulls(src: torch.device, dst: torch.device) -> bool:
        # A segmented run pulls copies between GPUs (see .peer).
        return issue is not None and src.type == dst.type == "cuda" and src != dst

    def pulled(receiver: int, sender: int) -> bool:
        return pulls(devices[sender], devices[receiver])

    def route(cutting: Cutting, s: int, m: int) -> None:
        route_grads(cutting, s, m, routes.hop, local, remote, readers, copiers, pulled)

    profiling = private.profiler_enabled()
    labels = list(targets)
    backward_seen: set[int] = set()
    roots: dict[tuple[int, int], list[tuple[tuple[int, int], Tensor]]] = {}
    cuts: dict[tuple[int, int], Cutting] = {}
    local: dict[tuple[int, int], Grads] = defaultdict(lambda: defaultdict(list))
    remote: dict[tuple[int, int, int], Grads] = defaultdict(lambda: defaultdict(list))
    losses: list[Tensor] = []
    task: Task | None = None
    # Split backwards: their weight passes, waiting for the weight tasks. A
    # checkpointed micro-batch is not split (see split_backward).
    split = {(s, m) for s, m in schedule.split if m >= checkpoint_stop}
    weights_left: dict[tuple[int, int], WeightPass] = {}
    graphs = worker.graphs
    thin: Replayed | None = None

    def thin_of(ref: Ref, m: int) -> bool:
        return thin is not None and thin.graphed(ref.stage, m)

    sched.check_device()
    # First: a run re-entered from inside a stage is refused before anything
    # of the run in progress (its graphs' slots) changes.
    native.begin_run(schedule.native, sched.caller_streams())
    try:
        if graphs is not None:
            graphs.begin(schedule, step=True)
            thin = Replayed(graphs, routes)
        for task in schedule.tasks if issue is None else issue.tasks:
            kind, s, m = task.kind, task.stage, task.micro
            # Everything a task issues, record_stream and the boundary cut
            # included, happens between begin and end: on the task's
            # streams, so autograd nodes and the allocator see them there.
            if kind is Kind.FORWARD:
                handle = native.begin(task.index)
                pairs, received = flow.args(s, m)
                sources = flow.result_sources(m) if s == last else []
                ckpt, splits = m < checkpoint_stop, (s, m) in split
                with task_range(profiling, kind, s, m):
                    replayed, y = (
                        (False, None)
                        if thin is None
                        else thin.forward(s, m, parts[s], pairs, ckpt, splits)
                    )
                    if readers[s] is not None:
                        # Read on this stage's stream, allocated on another
                        # (a replayed producer's buffers are kept by its slot).
                        fresh = [] if received else [v for r, v in pairs if not thin_of(r, m)]
                        protect(fresh + [v for _, v in sources], readers[s])
                    if replayed:
                        flow.store(s, m, y)
                        # Not cut: no autograd graph; the last stage's outputs
                        # are, for the loss to differentiate.
                        outs = flow.outputs_of(s, m) if s == last else ()
                        inputs: list[tuple[Ref, Any]] = [(Ref(s, k), v) for k, v in enumerate(outs)]
                    else:
                        inputs = thin.unalias(s, m, pairs) if thin and splits else pairs
                    cutting = Cutting()
                    values = cut_inputs(inputs + sources, cutting)
                    if cutting.keys:
                        cuts[(s, m)] = cutting
                    if not replayed:
                        y = _eager(graphs, s, parts[s], values[: len(inputs)], ckpt)
                        flow.store(s, m, y)
                    if s == last:
                        start = 0 if replayed else len(inputs)
                        cut = zip((inputs + sources)[start:], values[start:])
                        output = flow.result(m, {ref: v for (ref, _), v in cut})
                        loss = _loss(loss_fn, output, labels[m], readers[s], weights[m])
                        roots[(s, m)] = [((0, 0), loss if scale is None else scale(loss))]
                        losses.append(loss.detach())
                        del loss, output, cut
                if s < last and not replayed:
                    roots[(s, m)] = roots_of(flow.outputs_of(s, m))
                flow.release(s, m)
                if s == last:
                    flow.outs[m][s + 1] = None  # the loss holds what backward needs
                native.end(handle)
                # Locals must not keep a finished micro-batch's graph alive:
                # 1F1B's memory bound counts on it.
                del pairs, y, values, sources, inputs
            elif kind is Kind.COPY:
                handle = native.begin(task.index)
                hop = routes.by_task[(s, task.peer)]
                dst = devices[task.peer]
                with task_range(profiling, kind, s, m), torch.no_grad():
                    items, specs, where = hop_leaves(flow.hop_values(hop, m))
                    if s < 0:
                        sent = flow.outputs_of(-1, m)
                        buffers = _input_staging(staging, m, hop, sent, where)
                        for i, b in zip(where, buffers):
                            if pulls(items[i].device, dst):
                                items[i] = pull(items[i], dst)
                            else:
                                items[i] = to_device(items[i], dst, b)
                    elif pulls(devices[s], dst):
                        for i in where:
                            items[i] = pull(items[i], dst)
                    else:
                        protect([items[i] for i in where], copiers[s])
                        for i in where:
                            items[i] = move(items[i], dst, force=force)
                    moved = rebuild_hop(items, specs)
                protect(moved, readers[task.peer])
                flow.put_moved(hop, m, moved)
                native.end(handle)
            elif kind is Kind.TARGET:
                handle = native.begin(task.index)
                with task_range(profiling, kind, s, m), torch.no_grad():
                    buffers_t = target_staging[m] if target_staging else None
                    labels[m] = _transfer(labels[m], devices[last], buffers_t)
                protect([labels[m]], readers[last])
                native.end(handle)
            elif kind is Kind.BACKWARD:
                handle = native.begin(task.index)
                if before_backward is not None and s not in backward_seen:
                    backward_seen.add(s)
                    before_backward(s)
                with task_range(profiling, kind, s, m):
                    replayed = thin is not None and thin.graphed(s, m)
                    if replayed and s == last:
                        _backward(roots.pop((s, m)), None)  # the loss, to the cut outputs
                        route(cuts.pop((s, m)), s, m)
                    reached = None if s == last and not replayed else local.pop((s, m), {})
                    if replayed:
                        assert thin is not None and reached is not None
                        done = thin.backward(s, m, reached, (s, m) in split)
                    else:
                        if (s, m) in split:
                            weights_left[(s, m)] = _backward_inputs(roots.pop((s, m)), reached)
                        else:
                            _backward(roots.pop((s, m)), reached)
                        done = cuts.pop((s, m), None)
                    del reached
                if done is not None:
                    route(done, s, m)
                native.end(handle)
            elif kind is Kind.WEIGHT:
                handle = native.begin(task.index)
                pending = weights_left.pop((s, m), None)
                with task_range(profiling, kind, s, m):
                    if pending is not None:
                        pending.run()
                    elif thin is not None:
                        thin.weight(s, m)
                del pending
                native.end(handle)
            elif kind is Kind.COPY_GRAD:
                # The gradient of what stage s sent to task.peer's device.
                handle = native.begin(task.index)
                incoming = remote.pop((s, task.peer, m), {})
                with task_range(profiling, kind, s, m), torch.no_grad():
                    for key, grads in incoming.items():
                        if pulls(devices[task.peer], devices[s]):
                            # Summed here: the sender's streams are not this task's.
                            g = sum_grads([pull(x, devices[s]) for x in grads])
                        else:
                            g = move(sum_grads(grads), devices[s], force=force)
                        protect([g], readers[s])
                        local[(s, m)][key].append(g)
                native.end(handle)
        task = None
        native.join()
        if graphs is not None:
            graphs.end()  # after the join: on the caller's streams
    except BaseException as exc:
        try:
            if issue is None:
                sched.abort(exc)
            else:
                issue.abort(exc)
        finally:
            if graphs is not None:
                try:
                    graphs.end()
                except Exception as cleanup:  # a sticky device error: exc stays the one raised
                    annotate(exc, f"mpstream: ending the graphed stages raised too: {cleanup!r}")
        worker.annotate(exc, task, len(batches), _loss.__code__)
        raise
    if caller_reader is not None:
        for loss in losses:
            record_stream(loss, caller_reader)
    return losses


def _input_staging(
    staging: Sequence[Staging] | None,
    m: int,
    hop: Hop,
    inputs: Sequence[Any],
    where: Sequence[int],
) -> Sequence[Tensor | None]:
    buffers = hop_staging(staging, m, hop, inputs, where)
    return buffers if buffers is not None else (None,) * len(where)

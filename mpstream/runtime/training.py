"""A training step's tasks: forwards, copies, targets, backwards, weights and
gradient copies, issued by the one run loop (:mod:`~mpstream.runtime.executor`).

The autograd graph is cut at every stage's inputs (:mod:`~mpstream.runtime.boundary`),
so each stage's backward is a task of its own, scheduled like its forward.
The gradient of a value a stage read comes out of the cut; when the value
crossed devices a gradient-copy task sends it back (the same
:func:`~mpstream.runtime.copy.send` as every copy), summed first over the
stages on that device that read it; the producing stage's backward sums what
reached it and back-propagates its outputs. Parameter gradients accumulate
through autograd as usual. Where the schedule splits a backward (a weight
task follows it), the backward task computes the input gradients only and
the weight task the parameter gradients (:mod:`~mpstream.runtime.split_backward`).
A stage replayed from CUDA graphs runs its tasks without autograd, through
:mod:`~mpstream.runtime.replayed`; to the stages around it, it is one more
producer of outputs and consumer of gradients. Deferred BatchNorm updates
once the whole step succeeded (:func:`run` holds it around the loop, which
begins and ends the graphed stages' step).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..memory.batchnorm import DeferredBatchNorm, deferred_update
from ..memory.checkpoint import run_eagerly
from ..schedules.schedule import Kind, Schedule, Task
from .boundary import (
    Cutting,
    Grads,
    backward_from,
    backward_starts,
    cut_inputs,
    roots_of,
    route_grads,
    sum_grads,
)
from .copy import send
from .errors import annotate, inplace_hint, input_versions
from .executor import execute
from .graph import Ref
from .hops import send_hop
from .losses import Losses
from .replayed import Replayed
from .runs import Run
from .split_backward import WeightPass, backward_inputs
from .stream import current_stream
from .transfer import Staging, micro_to_device
from .values import cuda_only, protect

if TYPE_CHECKING:
    from .worker import Worker

__all__ = ["run"]


class _Step(Run):
    """The state of one training step and its task handlers."""

    step = True

    def __init__(
        self,
        worker: Worker,
        batches: Sequence[tuple[Any, ...]],
        targets: Sequence[Any],
        schedule: Schedule,
        loss_fn: Callable[[Any, Any], Tensor],
        weights: Sequence[float],
        checkpoint_stop: int,
        staging: Sequence[Staging] | None,
        target_staging: Sequence[Staging] | None,
        before_backward: Callable[[int], None] | None,
        scale: Callable[[Tensor], Tensor] | None,
        after_grads: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(worker, batches, schedule, checkpoint_stop, staging)
        self.devices = self.sched.devices
        self.copiers = cuda_only(self.sched.copy_streams)
        self.losses = Losses(loss_fn, weights, scale)
        self.target_staging = target_staging
        self.before_backward = before_backward
        self.after_grads = after_grads
        # Per stage, its last task that accumulates into its gradients.
        self.final: dict[int, tuple[Kind, int]] = (
            {}
            if after_grads is None
            else {
                t.stage: (t.kind, t.micro)
                for t in schedule.tasks
                if t.kind in (Kind.BACKWARD, Kind.WEIGHT)
            }
        )
        self.targets = list(targets)
        self.backward_seen: set[int] = set()
        self.roots: dict[tuple[int, int], list[tuple[tuple[int, int], Tensor]]] = {}
        self.cuts: dict[tuple[int, int], Cutting] = {}
        # Per (stage, micro-batch) run, the (output, leaf) keys of its outputs
        # that carry gradients: only those are cut in their readers (and
        # need a gradient there), so that a value needing none in the plain
        # model needs none in the pipe (every parameter frozen: no gradient,
        # as loss.backward() would refuse). Small: kept for the step.
        self.carried: dict[tuple[int, int], Container[tuple[int, int]]] = {}
        # Filled with setdefault (route_grads): a defaultdict's factory is a
        # call per key.
        self.local: dict[tuple[int, int], Grads] = {}
        self.remote: dict[tuple[int, int, int], Grads] = {}
        # Split backwards: their weight passes, waiting for the weight tasks.
        # A checkpointed micro-batch is not split (see split_backward).
        self.split = {(s, m) for s, m in schedule.split if m >= checkpoint_stop}
        self.weights_left: dict[tuple[int, int], WeightPass] = {}
        # The graphed stages' tasks (their graphs are begun by the executor).
        graphs = self.graphs
        self.replays = None if graphs is None else Replayed(graphs, self.routes)

    def route(self, cutting: Cutting, s: int, m: int) -> None:
        hops = self.routes.hops
        route_grads(cutting, s, m, hops, self.local, self.remote, self.readers, self.copiers)

    # Everything a task issues, record_stream and the boundary cut included,
    # happens inside its handler: between the scheduler's begin and end, on
    # the task's streams, so autograd nodes and the allocator see them there.
    # A handler's locals go with it: they must not keep a finished
    # micro-batch's graph alive (1F1B's memory bound counts on it).

    def forward(self, task: Task) -> None:
        s, m = task.stage, task.micro
        flow, last, replays = self.flow, self.last, self.replays
        pairs, received = flow.args(s, m)
        sources = flow.result_sources(m) if s == last else []
        ckpt, splits = m < self.checkpoint_stop, (s, m) in self.split
        replayed, y = (
            (False, None)
            if replays is None
            else replays.forward(s, m, self.parts[s], pairs, ckpt, splits, self.carried)
        )
        reader = self.readers[s]
        if reader is not None:
            # Read on this stage's stream, allocated on another (a replayed
            # producer's buffers are kept by its slot).
            fresh = (
                []
                if received
                else [v for r, v in pairs if replays is None or not replays.graphed(r.stage, m)]
            )
            protect(fresh + [v for _, v in sources], reader)
        if replayed:
            assert replays is not None
            self.carried[(s, m)] = replays.carried(s, m)
            if flow.outputs[s] == 1 and type(y) is Tensor:  # store()'s common case, inline
                flow.outs[m][s + 1] = (y,)
            else:
                flow.store(s, m, y)
            # Not cut: no autograd graph; the last stage's outputs are, for
            # the loss to differentiate.
            inputs: list[tuple[Ref, Any]] = []
            if s == last:
                outs = flow.outs[m][s + 1]
                assert outs is not None
                for k, v in enumerate(outs):
                    inputs.append((Ref(s, k), v))
        else:
            inputs = replays.unalias(s, m, pairs) if replays and splits else pairs
            if replays and splits and sources:
                # The loss's weight pass may read them too (a weight of the
                # loss_fn's own applied to another stage's output).
                sources = replays.unalias(s, m, sources)
        values: list[Any] = []
        if inputs or sources:  # else (a replayed stage but the last) nothing to cut
            cutting = Cutting()
            values = cut_inputs(inputs + sources, cutting, self.carried, m)
            if cutting.keys:
                self.cuts[(s, m)] = cutting
        if not replayed:
            args, stage = values[: len(inputs)], self.parts[s]
            graphs = self.graphs
            y = (
                run_eagerly(stage, args, ckpt)
                if graphs is None
                else graphs.eager(s, stage, args, ckpt)
            )
            flow.store(s, m, y)
        if s == last:
            start = 0 if replayed else len(inputs)
            replaced: dict[Ref, Any] = {}
            for (ref, _), v in zip((inputs + sources)[start:], values[start:]):
                replaced[ref] = v
            output = flow.result(m, replaced)
            root = self.losses.compute(m, output, self.targets[m], reader)
            self.roots[(s, m)] = [((0, 0), root)]
        elif not replayed:
            roots = self.roots[(s, m)] = roots_of(flow.outputs_of(s, m))
            keys: set[tuple[int, int]] = set()
            for key, _ in roots:
                keys.add(key)
            self.carried[(s, m)] = keys
        flow.release(s, m)
        if s == last:
            flow.outs[m][s + 1] = None  # the loss holds what backward needs

    def copy(self, task: Task) -> None:
        s = task.stage
        hop = self.routes.by_task[(s, task.peer)]
        with torch.no_grad():  # the graph is cut at the stage inputs
            send_hop(self.flow, hop, self.sched, task, self.staging, force=self.force, grad=False)

    def target(self, task: Task) -> None:
        m, last = task.micro, self.last
        with torch.no_grad():
            buffers = self.target_staging[m] if self.target_staging else None
            # Marked for the last stage's stream where the loss reads it
            # (Losses.compute), as a stage marks what it reads.
            self.targets[m] = micro_to_device(self.targets[m], self.devices[last], buffers)

    def backward(self, task: Task) -> None:
        s, m = task.stage, task.micro
        if self.before_backward is not None and s not in self.backward_seen:
            self.backward_seen.add(s)
            self.before_backward(s)
        replays = self.replays
        replayed = replays is not None and (s, m) in replays.calls  # replays.graphed(s, m), inline
        seed = self.losses.seeds[m] if s == self.last else None
        if replayed and s == self.last:
            # The loss, to the cut outputs (backward_from's case, inline: the
            # last stage's roots are its loss alone).
            ((_, loss),) = self.roots.pop((s, m))
            torch.autograd.backward([loss], None if seed is None else [seed])
            cut = self.cuts.pop((s, m), None)
            if cut is not None:  # else no output the loss read carries a gradient
                self.route(cut, s, m)
        reached = None if s == self.last and not replayed else self.local.pop((s, m), {})
        if replayed:
            assert replays is not None and reached is not None
            done = replays.backward(s, m, reached, (s, m) in self.split)
        else:
            if (s, m) in self.split:
                roots = self.roots.pop((s, m))
                starts = backward_starts(roots, reached, seed)
                self.weights_left[(s, m)] = backward_inputs(*starts)
            else:
                backward_from(self.roots.pop((s, m)), reached, seed)
            done = self.cuts.pop((s, m), None)
        if done is not None:
            self.route(done, s, m)
        if self.after_grads is not None:
            self._ended(task)

    def weight(self, task: Task) -> None:
        s, m = task.stage, task.micro
        pending = self.weights_left.pop((s, m), None)
        if pending is not None:
            pending.run()
        elif self.replays is not None:
            self.replays.weight(s, m)
        if self.after_grads is not None:
            self._ended(task)

    def _ended(self, task: Task) -> None:
        """After a gradient task (where ``after_grads`` is given, as the
        callers check): the stage's last one tells ``after_grads``."""
        if self.after_grads is not None and self.final.get(task.stage) == (task.kind, task.micro):
            self.after_grads(task.stage)

    def copy_grad(self, task: Task) -> None:
        # The gradient of what stage s sent to task.peer's device.
        s, m = task.stage, task.micro
        dst, reader = self.devices[s], self.readers[s]
        incoming = self.remote.pop((s, task.peer, m), {})
        with torch.no_grad():
            for key, grads in incoming.items():
                g = send(sum_grads(grads), dst, None, reader, force=self.force)
                self.local.setdefault((s, m), {}).setdefault(key, []).append(g)

    handlers = {
        Kind.FORWARD: forward,
        Kind.COPY: copy,
        Kind.TARGET: target,
        Kind.BACKWARD: backward,
        Kind.WEIGHT: weight,
        Kind.COPY_GRAD: copy_grad,
    }


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
    after_grads: Callable[[int], None] | None = None,
    norms: Sequence[DeferredBatchNorm] = (),
) -> Tensor:
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
        scale: applied to each loss, inside the last stage's forward task,
            before its backward (``GradScaler.scale``; the backward starts
            from the micro-batch's weight); the returned loss stays unscaled.
        after_grads: called with a stage's index inside its last backward
            or weight task of the step, on its stream, once that task has
            issued its work: no more of the step accumulates into the
            stage's own parameters (a parameter another stage shares may
            still get that stage's).
        norms: the pipeline's deferred BatchNorm layers: they update once
            the whole step succeeded, else drop what it accumulated
            (:func:`~mpstream.memory.batchnorm.deferred_update`; held to the
            step's end: a norm called twice per micro-batch updates from
            all its calls).

    Returns:
        The step's loss, the sum of the micro-batches' weighted losses
        (detached), computed on the caller's current stream of the last
        device.

    Raises:
        TypeError: a stage returned an unsupported value, or ``loss_fn`` did
            not return a scalar tensor.
    """
    with deferred_update(norms, len(batches)):
        (caller_reader,) = cuda_only([current_stream(worker.sched.devices[-1])])
        state = _Step(
            worker,
            batches,
            targets,
            schedule,
            loss_fn,
            weights,
            checkpoint_stop,
            staging,
            target_staging,
            before_backward,
            scale,
            after_grads,
        )
        code = Losses.compute.__code__
        versions = input_versions(batches)
        try:
            execute(worker, schedule, state, len(batches), loss=code)
        except Exception as exc:
            hint = inplace_hint(exc, batches, versions)
            if hint is not None:
                annotate(exc, hint)
            raise
        return state.losses.total(caller_reader)

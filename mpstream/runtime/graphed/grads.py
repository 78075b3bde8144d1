"""A stage's parameter gradients summed over a training step, handed over once.

Returned to autograd at every replay, a graphed stage's parameter gradients
cost two operations per parameter and micro-batch: a copy out of the
graph's buffers and autograd's accumulation into ``.grad``. With ten
micro-batches of ResNet50 that is thousands of small launches per step, the
host work graphs exist to remove. During ``train_step`` (the run ends in
one place) a stage's replays instead add their gradients into one
accumulator per parameter on the stage's stream, with one multi-tensor add
per replay (straight into ``.grad`` where a parameter of this stage alone
has one), and the run hands the sums over once at its end
(:meth:`StageGrads.flush`). In the user's own loop, one ``loss.backward()``
covers every micro-batch: the sums are held for that backward pass and
handed over by autograd's final callback. A replay whose parameters autograd would not
accumulate (``torch.autograd.grad``) still returns its gradients, and a
stage with a parameter's post-accumulate-grad hook is not held. Hooks on a
parameter's AccumulateGrad node itself (DeepSpeed's and Megatron's style)
see no gradient during a held step: the step's gradients reach ``.grad``
at its end.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..stream import current_stream, record_stream

__all__ = ["StageGrads"]


class StageGrads:
    """The gradients one stage's replays summed during a run.

    Attributes:
        enabled: whether replays may hold their gradients at all (off
            under DDP: its reducer hooks on AccumulateGrad need each
            micro-batch's gradient there).
        holding: replays add into the sums (during ``train_step``) instead
            of returning their gradients to autograd; outside it, a
            backward pass is held by :meth:`hold_task`.
        shared: ids of the parameters other stages use too (tied weights),
            whose gradients are never added into ``.grad`` from this
            stage's stream.
    """

    def __init__(self) -> None:
        self.enabled = True
        self.holding = False
        self.shared: frozenset[int] = frozenset()
        self._sums: dict[int, tuple[Tensor, Tensor]] = {}  # id(parameter) -> (it, its sum)
        self._streams: dict[int, torch.cuda.Stream] = {}  # where the adds ran
        self._task = -1  # the backward pass held by hold_task()

    def hold_task(self) -> bool:
        """Holds for the running backward pass (``loss.backward()`` in the
        user's own loop: one pass, every micro-batch) and flushes at its end,
        through autograd's final callback; whether it holds. Sums a failed
        pass left behind are dropped first."""
        task = _graph_task()
        if task < 0 or not self.enabled:
            return False
        if task != self._task:
            self.discard()
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_task)
        return True

    def _end_task(self) -> None:
        self._task = -1
        self.flush()

    def add(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
        """Adds ``grads`` for ``params`` on the current stream, with one
        multi-tensor add: into the parameter's ``.grad`` where it exists
        (no second copy of the gradients lives beside it; a failed step's
        snapshot puts it back), else into its sum (the first gradient
        copied)."""
        into: list[tuple[Tensor, Tensor]] = []
        new: list[tuple[Tensor, Tensor]] = []
        for p, g in zip(params, grads):
            held = self._sums.get(id(p))
            if held is not None:
                into.append((held[1], g))
            elif _addable(p.grad, g) and id(p) not in self.shared:
                into.append((p.grad, g))  # type: ignore[arg-type]
            else:
                new.append((p, g))
        if into:
            torch._foreach_add_([t for t, _ in into], [g for _, g in into])
        for p, g in new:
            self._sums[id(p)] = (p, g.clone())
        if grads and grads[0].is_cuda:
            stream = torch.cuda.current_stream(grads[0].device)
            self._streams[stream.stream_id] = stream

    def flush(self) -> None:
        """Hands the sums to ``.grad`` (on the caller's streams, which the
        run ordered after every stage's) and starts over: a sum becomes the
        gradient of a parameter that has none, or is added into the one it
        has (autograd accumulates what fits neither, a sparse gradient)."""
        pairs, self._sums = list(self._sums.values()), {}
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:  # where the adds ran (the run's join did it too)
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        into: list[tuple[Tensor, Tensor]] = []
        rest: list[tuple[Tensor, Tensor]] = []
        for p, total in pairs:
            if p.grad is None and total.layout == torch.strided:
                # Made on the stage's stream, used on the caller's from now on.
                record_stream(total, current_stream(total.device))
                p.grad = total
            elif _addable(p.grad, total):
                into.append((p.grad, total))  # type: ignore[arg-type]
            else:
                rest.append((p, total))
        if into:
            torch._foreach_add_([g for g, _ in into], [t for _, t in into])
        if rest:
            torch.autograd.backward([p for p, _ in rest], [t for _, t in rest])

    def discard(self) -> None:
        """Drops the sums (a failed run: its gradients are put back)."""
        self._sums = {}
        self._streams = {}


def _graph_task() -> int:
    """The running backward pass's id; -1 outside one (or in a torch
    without the query)."""
    query = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if query is None else int(query())


def _addable(grad: Tensor | None, g: Tensor) -> bool:
    """Whether ``g`` can be added into ``grad`` in place as autograd would."""
    return (
        grad is not None
        and grad.layout == g.layout == torch.strided
        and grad.shape == g.shape
        and grad.dtype == g.dtype
        and grad.device == g.device
    )

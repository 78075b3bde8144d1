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
(:meth:`StageGrads.flush`). A replay whose parameters autograd would not
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
        holding: replays add into the sums (during ``train_step``) instead
            of returning their gradients to autograd.
        shared: ids of the parameters other stages use too (tied weights),
            whose gradients are never added into ``.grad`` from this
            stage's stream.
    """

    def __init__(self) -> None:
        self.holding = False
        self.shared: frozenset[int] = frozenset()
        self._sums: dict[int, tuple[Tensor, Tensor]] = {}  # id(parameter) -> (it, its sum)

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

    def flush(self) -> None:
        """Hands the sums to ``.grad`` (on the caller's streams, which the
        run ordered after every stage's) and starts over: a sum becomes the
        gradient of a parameter that has none, or is added into the one it
        has (autograd accumulates what fits neither, a sparse gradient)."""
        pairs, self._sums = list(self._sums.values()), {}
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


def _addable(grad: Tensor | None, g: Tensor) -> bool:
    """Whether ``g`` can be added into ``grad`` in place as autograd would."""
    return (
        grad is not None
        and grad.layout == g.layout == torch.strided
        and grad.shape == g.shape
        and grad.dtype == g.dtype
        and grad.device == g.device
    )

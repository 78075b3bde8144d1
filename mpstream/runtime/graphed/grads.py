"""A stage's parameter gradients summed over a training step, handed over once.

Returned to autograd at every replay, a graphed stage's parameter gradients
cost two operations per parameter and micro-batch: a copy out of the
graph's buffers and autograd's accumulation into ``.grad``. With ten
micro-batches of ResNet50 that is thousands of small launches per step, the
host work graphs exist to remove. During ``train_step`` (the run ends in
one place) a stage's replays instead add their gradients into one
accumulator per parameter on the stage's stream, with one multi-tensor add
per replay, and the run hands the sums to autograd once at its end
(:meth:`StageGrads.flush`): ``.grad`` is accumulated as by a plain
backward (AccumulateGrad, its hooks and layout), once per step instead of
once per micro-batch. A replay whose parameters autograd would not
accumulate (``torch.autograd.grad``) still returns its gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["StageGrads"]


class StageGrads:
    """The gradients one stage's replays summed during a run.

    Attributes:
        holding: replays add into the sums (during ``train_step``) instead
            of returning their gradients to autograd.
    """

    def __init__(self) -> None:
        self.holding = False
        self._sums: dict[int, tuple[Tensor, Tensor]] = {}  # id(parameter) -> (it, its sum)

    def add(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
        """Adds ``grads`` into the sums of ``params``, on the current stream:
        the first gradient of a parameter is copied, later ones added with
        one multi-tensor add."""
        sums, new = [], []
        for p, g in zip(params, grads):
            held = self._sums.get(id(p))
            if held is None:
                new.append((p, g))
            else:
                sums.append((held[1], g))
        if sums:
            torch._foreach_add_([s for s, _ in sums], [g for _, g in sums])
        for p, g in new:
            self._sums[id(p)] = (p, g.clone())

    def flush(self) -> None:
        """Accumulates the sums into ``.grad`` through autograd (on the
        caller's streams, which the run ordered after every stage's) and
        starts over."""
        pairs, self._sums = list(self._sums.values()), {}
        if pairs:
            torch.autograd.backward([p for p, _ in pairs], [s for _, s in pairs])

    def discard(self) -> None:
        """Drops the sums (a failed run: its gradients are put back)."""
        self._sums = {}

"""Timing a stage's backward when autograd, not the scheduler, runs it.

After ``pipe(x)``, ``loss.backward()`` runs each stage's backward inside
autograd, so no scheduler task brackets it. While timing is on, the forward
wraps each stage's output in :class:`_Begin` and its input in :class:`_End`:
identities whose backward records a start mark when the gradient reaches the
stage's output and an end mark when it leaves the stage's input. Autograd
runs both on the stage's compute stream (the stream their forward ran on), so
on a GPU the marks are events on that stream. Each mark counts in the run
whose forward built the graph, however many runs came in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _ext
from .microbatch import grad_dtype, gradless, leaves, rebuild_leaves

__all__ = ["StageMarks", "enter", "leave"]

_BACKWARD = _ext.load().Kind.backward

# Requires grad so the end mark fires even when the stage input does not.
_ANCHOR = torch.empty(0, requires_grad=True)


class StageMarks:
    """Links the begin and end marks of one stage's backward on one micro-batch."""

    __slots__ = ("native", "stage", "micro", "run", "mark")

    def __init__(self, native: Any, stage: int, micro: int) -> None:
        self.native = native
        self.stage = stage
        self.micro = micro
        self.run = native.run_tag  # the forward's run: the backward may come later
        self.mark = -1


def _detached(tensors: tuple[Tensor, ...], ctx: Any, *, anchored: bool) -> tuple[Tensor, ...]:
    out = tuple(t.detach() for t in tensors)
    if anchored:
        # Every float input gets a gradient path, so that the stage's
        # backward ends with this mark even where its inputs need none.
        ctx.mark_non_differentiable(*[t for t in out if not grad_dtype(t)])
    else:
        ctx.mark_non_differentiable(*gradless(tensors, out))
    ctx.set_materialize_grads(False)
    return out


class _Begin(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, marks: StageMarks, *outputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.marks = marks
        return _detached(outputs, ctx, anchored=False)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:
        m: StageMarks = ctx.marks
        m.mark = m.native.begin_mark(_BACKWARD, m.stage, m.micro, m.run)
        return (None, *grads)


class _End(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, marks: StageMarks, anchor: Tensor, *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.marks = marks
        return _detached(inputs, ctx, anchored=True)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:
        m: StageMarks = ctx.marks
        m.native.end_mark(m.mark)
        return (None, None, *grads)


def _wrap(value: Any, apply: Any) -> Any:
    items, spec = leaves(value)
    where = [i for i, t in enumerate(items) if isinstance(t, Tensor)]
    if not where:
        return value
    for i, t in zip(where, apply(*[items[i] for i in where])):
        items[i] = t
    return rebuild_leaves(items, spec)


def enter(native: Any, stage: int, micro: int, args: Sequence[Any]) -> tuple[list[Any], StageMarks]:
    """Wraps a stage's arguments; call inside the stage's task."""
    marks = StageMarks(native, stage, micro)
    wrapped = _wrap(tuple(args), lambda *ts: _End.apply(marks, _ANCHOR, *ts))
    return list(wrapped), marks


def leave(marks: StageMarks, y: Any) -> Any:
    """Wraps a stage's outputs; call inside the stage's task."""
    return _wrap(y, lambda *ts: _Begin.apply(marks, *ts))

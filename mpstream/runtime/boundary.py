"""Cutting the autograd graph between stages for explicitly scheduled backward.

In ``train_step`` each stage's backward is its own task, so the graph is cut
at stage inputs. :class:`Boundary` returns its inputs detached (no copy) and,
in backward, hands the gradient that reached the cut to a :class:`GradSink`
instead of passing it on. A constant anchor that requires grad makes the
outputs require grad, so autograd reaches the boundary from the stage's
roots; and because the outputs are not leaves, a stage may start with an
in-place op (``ReLU(inplace=True)``), which a ``detach().requires_grad_()``
leaf would forbid.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["GradSink", "Boundary", "cut"]

# Requires grad so the boundary's outputs do; never receives a gradient.
_ANCHOR = torch.empty(0, requires_grad=True)


class GradSink:
    """Receives the gradients that reach one stage input of one micro-batch."""

    __slots__ = ("grads",)

    def __init__(self) -> None:
        self.grads: tuple[Tensor | None, ...] | None = None


class Boundary(torch.autograd.Function):
    """Identity on the values; stops and captures the gradient."""

    @staticmethod
    def forward(ctx: Any, sink: GradSink, anchor: Tensor, *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.sink = sink
        outputs = tuple(x.detach() for x in inputs)
        ctx.mark_non_differentiable(*[y for y in outputs if not y.is_floating_point()])
        ctx.set_materialize_grads(False)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, ...]:
        ctx.sink.grads = grads
        return (None,) * (len(grads) + 2)


def cut(sink: GradSink, tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Detaches ``tensors`` from their producer; their gradients go to ``sink``."""
    # Detach before the boundary too: otherwise its node would link back to
    # the producer's graph, and autograd would walk (and free) that graph
    # with empty gradients during this stage's backward.
    out: tuple[Tensor, ...] = Boundary.apply(sink, _ANCHOR, *(t.detach() for t in tensors))
    return out

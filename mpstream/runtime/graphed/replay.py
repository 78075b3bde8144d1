"""The autograd node of a replayed stage call.

:class:`Replay` is what autograd sees of a :class:`~.call.GraphedCall`:
its forward replays the forward graph, its backward the backward graph
(or, where a zero-bubble schedule splits the backward, B now and W as a
:class:`Later` the weight task runs). Under ``train_step`` a replay shows
autograd one parameter only: every parameter gradient goes to the stage's
sums (:mod:`.grads`), and autograd walks no edge per parameter.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .call import GraphedCall

__all__ = ["Replay", "Later"]


class Replay(torch.autograd.Function):
    """Replays a :class:`GraphedCall`; its backward replays the backward graph."""

    @staticmethod
    def forward(ctx: Any, call: GraphedCall, held: bool, *tensors: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.call = call
        ctx.held = held  # its parameter gradients go to the sums, not autograd
        ctx.n_params = len(tensors) - len(call.where)  # parameters given as inputs
        ctx.set_materialize_grads(False)  # backward tells "no gradient" from zeros
        outs = call._forward(tensors[: len(call.where)])
        call.replays += 1
        ctx.replay = call.replays
        call.pending = weakref.ref(ctx)
        ctx.splits = call.weighs_later  # B may defer W (see split_backward)
        keep = set(call.diff_out)
        ctx.mark_non_differentiable(*(t for k, t in enumerate(outs) if k not in keep))
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        call: GraphedCall = ctx.call
        if torch.is_grad_enabled():  # autograd runs a backward with grad mode = create_graph
            raise RuntimeError(
                f"{call.label}: a backward with create_graph=True (a gradient penalty, a "
                f"higher-order gradient) differentiates the backward, which a replayed graph "
                f"cannot: its gradients would carry no history; run the pipe with graphs=False "
                f"for that"
            )
        if getattr(ctx, "done", False):
            raise RuntimeError(
                f"{call.label}: a second backward through the same graphed forward "
                f"(retain_graph=True) would read activations its first backward reused; "
                f"run the pipe with graphs=False for that"
            )
        ctx.done = True
        if all(g is None for g in grads):
            # No gradient reached this call (its outputs feed nothing the loss
            # depends on): eager autograd computes nothing here, while a
            # replay would hand the parameters zeros where they have None.
            call.pending = None
            return (None,) * (2 + len(call.static_in) + int(ctx.n_params))
        if ctx.replay != call.replays:
            raise RuntimeError(
                f"{call.label}: its graphs replayed another micro-batch's forward before this "
                f"backward, so the activations it needs are gone (a backward run twice with "
                f"retain_graph=True after a new forward?); run the pipe with graphs=False for that"
            )
        none = [None] * ctx.n_params
        if getattr(ctx, "defer", False):
            # Set by a split backward's B: W replays when the weight task runs.
            grads_now = call._backward(grads, defer=True)
            replay = ctx.replay
            later = Later(lambda: call._weights(replay))
            ctx.later = later
            call.pending = weakref.ref(later)
            return (None, None, *grads_now, *none)
        call.pending = None
        grads_in = call._backward(grads, defer=False)
        if ctx.held:
            call._hold()
            return (None, None, *grads_in, *none)
        return (None, None, *grads_in, *call._params_out())


class Later:
    """A graphed call's deferred weight pass (weakly referenced by the call:
    its slot stays busy while W may still run)."""

    __slots__ = ("fn", "__weakref__")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def __call__(self) -> None:
        self.fn()

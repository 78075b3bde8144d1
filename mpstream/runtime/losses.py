"""A training step's losses: one per micro-batch, its weight, the step's total.

The last stage's forward task computes each micro-batch's loss on that
stage's stream; its backward starts from the loss with the micro-batch's
weight as the gradient (a seed), which gives every parameter what the
weighted loss would, without the three operators per micro-batch (the
multiply, its backward, a seed of ones) the host would issue for a weighted
loss. The step's total weights the losses once, at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .stream import AnyStream, record_stream
from .values import protect

__all__ = ["Losses"]


class Losses:
    """The losses of one training step.

    Args:
        loss_fn: ``loss_fn(output, target)`` returning a scalar.
        weights: factor of each micro-batch's loss.
        scale: applied to each loss before its backward
            (``GradScaler.scale``); the total stays unscaled.
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], Tensor],
        weights: Sequence[float],
        scale: Callable[[Tensor], Tensor] | None,
    ) -> None:
        self.loss_fn, self.weights, self.scale = loss_fn, weights, scale
        self.values: dict[int, Tensor] = {}  # detached, unweighted
        self.seeds: dict[int, Tensor] = {}
        self._made: dict[tuple[float, torch.dtype], Tensor] = {}

    def compute(self, m: int, output: Any, target: Any, reader: AnyStream | None) -> Tensor:
        """Micro-batch ``m``'s loss, on the last stage's stream; returns
        the tensor its backward starts from (scaled where asked).

        ``target`` sits on the last stage's device: moved there by its target
        task, or put there by the caller (then allocated on the caller's stream).

        Raises:
            TypeError: ``loss_fn`` did not return a scalar tensor.
            RuntimeError: the loss carries no gradient.
        """
        protect([target], reader)
        loss = _scalar(self.loss_fn(output, target))
        self.values[m] = loss.detach()
        self.seeds[m] = self._seed(self.weights[m], loss)
        return loss if self.scale is None else self.scale(loss)

    def _seed(self, weight: float, loss: Tensor) -> Tensor:
        # One per value and dtype for the step, made on the last stage's
        # stream, which runs every backward of the loss.
        key = (weight, loss.dtype)
        seed = self._made.get(key)
        if seed is None:
            seed = self._made[key] = torch.full((), weight, dtype=loss.dtype, device=loss.device)
        return seed

    def total(self, reader: AnyStream | None) -> Tensor:
        """The sum of the weighted losses (detached), computed on the
        current stream, which ``reader`` (None: not CUDA) names for the
        allocator: the losses were made on the last stage's."""
        if reader is not None:
            for t in (*self.values.values(), *self.seeds.values()):
                record_stream(t, reader)
        order = sorted(self.values)
        stacked = torch.stack([self.values[m] for m in order])
        chosen = {self.weights[m] for m in order}
        if len(chosen) == 1:  # a batch the micro-batches divide evenly: one multiply
            (weight,) = chosen
            total = stacked.sum()
            return total if weight == 1.0 else total * weight
        return (stacked * torch.stack([self.seeds[m] for m in order])).sum()


def _scalar(loss: object) -> Tensor:
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        what = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, Tensor)
            else type(loss).__name__
        )
        raise TypeError(f"loss_fn must return a scalar tensor, got {what}")
    if not loss.requires_grad and torch.is_grad_enabled():
        # Autograd would refuse it in the backward task, naming no cause.
        raise RuntimeError(
            "loss_fn returned a loss that does not require grad: nothing it was computed "
            "from carries a gradient (the last stage's output detached or computed under "
            "torch.no_grad(), or every parameter frozen?)"
        )
    return loss if loss.dim() == 0 else loss.reshape(())

"""A training step's losses: one per micro-batch, its weight, the step's total.

The last stage's forward task computes each micro-batch's loss on that
stage's stream; its backward starts from the loss with the micro-batch's
weight as the gradient (a seed), which gives every parameter what the
weighted loss would, without the multiply and its backward the host would
issue for a weighted loss. The weighted loss is added to the step's total in
the same task, aside from autograd.

Each micro-batch has its own seed, as autograd's own seed of ones would be:
autograd may keep a view of the gradient it hands a parameter as that
parameter's ``.grad`` (when nothing else holds the view: a loss that reaches a
parameter through views only, ``mse + s.squeeze()``) and add the next
micro-batches' gradients into it in place, which would change a seed later
backwards start from. The loss is read in its own task, not after the run:
it may alias a buffer a later task rewrites (a replayed last stage's static
output, when ``loss_fn`` returns the output itself).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from . import private
from .stream import AnyStream, record_stream
from .values import protect

__all__ = ["Losses"]

#: Sets grad mode without making an object per call.
_set_grad = private.grad_mode_switch()


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
        self.seeds: dict[int, Tensor] = {}
        self._total: Tensor | None = None  # detached, weighted
        self._dtype: torch.dtype | None = None  # the losses'

    def compute(self, m: int, output: Any, target: Any, reader: AnyStream | None) -> Tensor:
        """Micro-batch ``m``'s loss, on the last stage's stream; returns
        the tensor its backward starts from (scaled where asked).

        ``target`` sits on the last stage's device: moved there by its target
        task, or put there by the caller (then allocated on the caller's stream).

        Raises:
            TypeError: ``loss_fn`` did not return a scalar tensor.
            RuntimeError: the loss carries no gradient.
        """
        if reader is not None:
            protect([target], reader)
        loss = self.loss_fn(output, target)
        if type(loss) is not Tensor or loss.dim() != 0 or not loss.requires_grad:
            loss = _scalar(loss)  # checked, reshaped (a 0-dim loss with a gradient passes)
        weight = self.weights[m]
        # Its own: no other backward starts from it (see the module's notes).
        self.seeds[m] = torch.full((), weight, dtype=loss.dtype, device=loss.device)
        # Summed now, grad off: the loss may alias a buffer a later task
        # rewrites. Once per micro-batch: inline (private.grad_mode_switch).
        on = torch.is_grad_enabled()
        if on:
            _set_grad(False)
        try:
            if self._total is None:
                self._dtype = loss.dtype
                # Half-precision losses summed in float32, as torch.sum would.
                low = loss.dtype in (torch.float16, torch.bfloat16)
                self._total = (loss.float() if low else loss) * weight
            else:
                self._total.add_(loss, alpha=weight)
        finally:
            if on or torch.is_grad_enabled():
                _set_grad(on)
        return loss if self.scale is None else self.scale(loss)

    def total(self, reader: AnyStream | None) -> Tensor:
        """The sum of the weighted losses (detached), in the losses' dtype;
        summed on the last stage's stream, read after the run on the current
        one, which ``reader`` (None: not CUDA) names for the allocator."""
        total = self._total
        if total is None:
            raise RuntimeError("the step computed no loss")
        if reader is not None:
            record_stream(total, reader)  # read there, by the cast too
        return total if total.dtype == self._dtype else total.to(self._dtype)


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

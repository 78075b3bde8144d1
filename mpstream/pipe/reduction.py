"""How a training step adds up its micro-batches' losses.

``reduction='mean'`` weights each micro-batch's loss by its share of the
batch, ``'sum'`` by 1. A loss module says how it reduces itself
(``nn.MSELoss(reduction='sum')``): that decides the step's reduction when
none is given, and a step told otherwise is refused rather than weighted
wrongly.

``nn.CrossEntropyLoss`` and ``nn.NLLLoss`` averaging class indices divide by
a count that depends on the targets (those not ``ignore_index``, weighted by
their class's ``weight``), so their micro-batch means weighted by share
would not give the batch's mean: the step sums each micro-batch's terms and
divides by the whole batch's count instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..runtime.microbatch import NoChunk

__all__ = ["REDUCTIONS", "counted_mean", "step_reduction"]

REDUCTIONS = ("mean", "sum")


def step_reduction(reduction: str | None, loss_fn: Any) -> str:
    """The step's reduction: ``reduction``, or ``loss_fn``'s own.

    Args:
        reduction: ``'mean'``, ``'sum'``, or None to follow ``loss_fn``
            (``'mean'`` for a loss that does not say).
        loss_fn: the loss; a loss module's ``reduction`` attribute is read.

    Raises:
        ValueError: an unknown ``reduction``, or one that contradicts the
            loss module's.
    """
    own = getattr(loss_fn, "reduction", None)
    own = own if own in REDUCTIONS else None
    if reduction is None:
        return own or "mean"
    if reduction not in REDUCTIONS:
        valid = ", ".join(repr(r) for r in REDUCTIONS)
        raise ValueError(f"reduction must be one of {valid}; got {reduction!r}")
    if own is not None and own != reduction:
        raise ValueError(
            f"reduction={reduction!r}, but loss_fn reduces with {own!r}: each micro-batch's "
            f"loss would be weighted as a {reduction} while it is a {own}. Leave reduction "
            f"unset (it follows the loss), or give {own!r}"
        )
    return reduction


def counted_mean(
    loss_fn: Callable[[Any, Any], Tensor], reduction: str | None, target: Any
) -> tuple[Callable[[Any, Any], Tensor], str | None, Any]:
    """The step's loss, reduction and target, exact for a count-averaged loss.

    An ``nn.CrossEntropyLoss`` or ``nn.NLLLoss`` (not a subclass, whose
    ``forward`` may differ) that averages class indices becomes a sum over
    each micro-batch divided by the whole batch's count, which reaches every
    micro-batch's loss as a ``NoChunk`` beside its target. Anything else is
    returned as given.

    Args:
        loss_fn: the step's loss.
        reduction: the step's reduction (:func:`step_reduction`'s).
        target: the whole batch's target (detached).

    Returns:
        ``(loss_fn, reduction, target)``: as given, or the summing loss,
        ``'sum'`` and ``(target, NoChunk(count))``.
    """
    if (
        type(loss_fn) not in (nn.CrossEntropyLoss, nn.NLLLoss)
        or reduction != "mean"
        or type(target) is not Tensor
        or target.is_floating_point()  # class probabilities: a uniform mean
    ):
        return loss_fn, reduction, target
    module: Any = loss_fn
    kept = target != module.ignore_index
    weight: Tensor | None = module.weight
    if weight is None:
        count = kept.sum()
    else:
        # Kept targets per class, on the target's device, for the loss to
        # weigh where the weights are: copying the weights to the target
        # (a GPU's to the host) would block the host every step. Ignored
        # targets count at class 0 as 0. As integers: Byte targets, which
        # the loss takes, would index as a mask. A class out of range is
        # clamped: its micro-batch's loss raises, naming it.
        classes = torch.where(kept, target.long(), 0).clamp_(0, weight.numel() - 1)
        count = torch.zeros(weight.numel(), dtype=torch.long, device=target.device)
        count.index_add_(0, classes.flatten(), kept.flatten().long())
    return functools.partial(_summed, module), "sum", (target, NoChunk(count))


def _summed(module: Any, output: Tensor, target: tuple[Tensor, Tensor]) -> Tensor:
    """``module``'s loss summed over a micro-batch, divided by the batch's
    count (given, or weighed from the kept targets per class)."""
    labels, count = target
    losses = (
        nn.functional.cross_entropy(
            output,
            labels,
            module.weight,
            ignore_index=module.ignore_index,
            reduction="none",
            label_smoothing=module.label_smoothing,
        )
        if isinstance(module, nn.CrossEntropyLoss)
        else nn.functional.nll_loss(
            output, labels, module.weight, ignore_index=module.ignore_index, reduction="none"
        )
    )
    # Summed in float32 at least: a float16 micro-batch's sum overflows
    # where the batch's mean (accumulated wider by torch's kernels) does not.
    wide = torch.promote_types(losses.dtype, torch.float32)
    if module.weight is not None:
        count = (count.to(wide) * module.weight.to(wide)).sum()
    return (losses.sum(dtype=wide) / count).to(losses.dtype)

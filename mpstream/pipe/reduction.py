"""How a training step adds up its micro-batches' losses.

``reduction='mean'`` weights each micro-batch's loss by its share of the
batch, ``'sum'`` by 1. A loss module says how it reduces itself
(``nn.MSELoss(reduction='sum')``): that decides the step's reduction when
none is given, and a step told otherwise is refused rather than weighted
wrongly.
"""

from __future__ import annotations

from typing import Any

__all__ = ["REDUCTIONS", "step_reduction"]

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

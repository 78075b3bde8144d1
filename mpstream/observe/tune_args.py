"""What :func:`~mpstream.observe.tuning.tune` is given, checked before it
times anything: the split sizes to try (:func:`candidate_split_sizes` by
default, :func:`checked_sizes`), its counts and tolerance
(:func:`check_knobs`), and whether its loss needs a target
(:func:`needs_target`).
"""

from __future__ import annotations

import inspect
import numbers
import operator
from collections.abc import Callable, Sequence

from torch import Tensor, nn

from ..stages import check_positive

__all__ = ["candidate_split_sizes", "checked_sizes", "check_knobs", "needs_target"]

_CANDIDATES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)


def candidate_split_sizes(batch: int) -> list[int]:
    """Split sizes worth trying for a batch: a geometric-ish ladder up to it."""
    return sorted({s for s in _CANDIDATES if s <= batch} | {batch})


def needs_target(loss_fn: Callable[..., Tensor]) -> bool:
    """Whether ``loss_fn`` cannot be called with the output alone but can
    with a target too (``nn.MSELoss()``, ``F.mse_loss``): tune would fail
    inside its first step with the loss's own complaint."""
    fn = loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: let the call say
        return False
    try:
        signature.bind(None)
        return False
    except TypeError:
        pass
    try:
        signature.bind(None, None)
    except TypeError:
        return False
    return True


def check_knobs(repeat: object, warmup: object, patience: object, tolerance: object) -> None:
    """Refuses counts that are not ints and a tolerance that is not a number
    >= 0: a NaN tolerance compares false, so no size would ever count as
    slower and the sweep would never stop early."""
    check_positive("repeat", repeat)
    check_positive("patience", patience)
    if isinstance(warmup, bool) or not isinstance(warmup, numbers.Integral):
        raise TypeError(f"warmup must be an int, got {type(warmup).__name__}")
    if warmup < 0:
        raise ValueError(f"warmup must not be negative, got {warmup}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real):
        raise TypeError(f"tolerance must be a number, got {type(tolerance).__name__}")
    if not float(tolerance) >= 0:  # NaN too
        raise ValueError(
            f"tolerance must be a number >= 0 (the relative slack, e.g. 0.05), got {tolerance}"
        )


def checked_sizes(split_sizes: Sequence[int] | None, batch: int) -> list[int]:
    """The candidate split sizes, checked, in increasing order.

    Raises:
        ValueError: not a non-empty list of positive ints, a size given more
            than once, or one larger than ``batch``.
    """
    if split_sizes is None:
        return candidate_split_sizes(batch)
    try:
        split_sizes = list(split_sizes)  # a generator is read once
    except TypeError:  # one size, split_sizes=4
        raise ValueError(
            f"split_sizes must be a list of positive ints, got {split_sizes!r}; give "
            f"[{split_sizes!r}] to time that one split size"
        ) from None
    if not split_sizes:
        raise ValueError(
            "split_sizes=[] lists no split size to time: leave it out to try the default ones"
        )
    try:
        values = [operator.index(s) for s in split_sizes if not isinstance(s, bool)]
    except TypeError:
        values = []
    if len(values) != len(split_sizes) or min(values) < 1:
        raise ValueError(f"split_sizes must be positive ints, got {split_sizes!r}")
    # Each size is one configuration timed: a repeat would be timed once,
    # merged unsaid (the CLI's --split-sizes refuses it too).
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        sizes_word = "split size" if len(repeated) == 1 else "split sizes"
        raise ValueError(
            f"{sizes_word} {', '.join(map(str, repeated))} given more than once in "
            f"split_sizes={split_sizes!r}: give each once"
        )
    sizes = sorted(values)
    if sizes[-1] > batch:
        raise ValueError(f"split size {sizes[-1]} is larger than the batch of {batch}")
    return sizes

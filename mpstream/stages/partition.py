"""The contiguous split of per-layer costs into stages whose largest cost
is smallest: an exact dynamic programme over the layers' prefix sums, and
the cost of each stage of a split."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from .._words import count_of

__all__ = ["partition", "stage_costs"]


def partition(costs: Sequence[float], stages: int) -> list[int]:
    """Contiguous split of ``costs`` into ``stages`` non-empty parts.

    Minimises the largest part's sum; among equal optima, the one found first
    from the left.

    Args:
        costs: one non-negative cost per layer.
        stages: number of parts.

    Returns:
        The balance: layers per part.

    Raises:
        TypeError: ``stages`` is not an int.
        ValueError: fewer layers than stages, ``stages`` < 1, or a cost that is
            negative, infinite or NaN.
    """
    n = len(costs)
    # A float would reach range() below as a raw TypeError; True is no count.
    if isinstance(stages, bool) or not isinstance(stages, numbers.Integral):
        raise TypeError(f"stages must be an int, got {stages!r}")
    stages = int(stages)
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    if n < stages:
        raise ValueError(f"cannot split {count_of(n, 'layer')} into {stages} non-empty stages")
    bad = next((i for i, c in enumerate(costs) if not 0 <= float(c) < float("inf")), None)
    if bad is not None:
        # An infinite cost ties every split at infinity (one stage came out
        # empty), a NaN compares false with everything.
        raise ValueError(f"layer costs must be finite and not negative, got {costs[bad]} at {bad}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest max over splits of the first i layers into k parts.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    balance = []
    i = n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        balance.append(i - j)
        i = j
    return balance[::-1]


def stage_costs(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    """The summed cost of each stage of ``balance``."""
    out, start = [], 0
    for count in balance:
        out.append(float(sum(costs[start : start + count])))
        start += count
    return out

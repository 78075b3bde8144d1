"""How repeated timings of one configuration vary, and when they disagree.

On a shared machine another process can make one timing many times slower
than the others, and a ratio of means (or a choice by medians) then says
more about the machine than about what was timed. :func:`spread` measures
the variation; a configuration whose timings vary beyond :data:`MAX_CV` or
:data:`MAX_RANGE` is :func:`noisy`.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Spread", "spread", "noisy", "MAX_CV", "MAX_RANGE"]

#: A configuration's rounds are noisy beyond this coefficient of variation...
MAX_CV = 0.15
#: ... or when the slowest round takes this many times the fastest.
MAX_RANGE = 1.5


@dataclass(frozen=True)
class Spread:
    """How a configuration's rounds vary.

    Attributes:
        cv: standard deviation over mean.
        max_over_min: the slowest round over the fastest.
        q1, q3: the first and third quartiles (seconds).
        low, high: the fastest and slowest rounds (seconds).
    """

    cv: float
    max_over_min: float
    q1: float
    q3: float
    low: float
    high: float

    @property
    def noisy(self) -> bool:
        return self.cv > MAX_CV or self.max_over_min > MAX_RANGE

    def to_json(self) -> dict[str, float | bool]:
        return {**dataclasses.asdict(self), "noisy": self.noisy}


def spread(times: Sequence[float]) -> Spread:
    """The spread of ``times`` (a single round has none).

    Raises:
        ValueError: no times.
    """
    if not times:
        raise ValueError("no rounds to judge")
    mean = statistics.fmean(times)
    cv = statistics.pstdev(times) / mean if mean > 0 else 0.0
    low, high = min(times), max(times)
    q1, _, q3 = (
        # inclusive: quartiles stay within the rounds measured
        statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else (low, low, low)
    )
    # Rounds all too short to register (0 s each) agree with each other.
    ratio = high / low if low > 0 else (1.0 if high == 0 else float("inf"))
    return Spread(cv, ratio, q1, q3, low, high)


def noisy(times: Sequence[float]) -> bool:
    """Whether rounds ``times`` disagree beyond the limits (see :class:`Spread`)."""
    return spread(times).noisy

"""Judging overlap: the overlap fraction of a probe, and sizing probes so it means something.

A probe runs work whose parts were each timed alone, and compares the
measured time with two references computed from those parts:

- the serial sum: every task one after the other;
- the ideal: the same schedule on perfectly independent streams
  (:func:`mpstream.simulate` with the measured task costs).

The overlap fraction is ``(serial - measured) / (serial - ideal)``: 1 when
the streams overlap as well as the schedule allows, 0 when nothing
overlaps. :data:`TARGET` (0.9) is the project's target. Copies are sized to
take as long as a stage (:func:`size_copy`), so that if copies serialised
with compute instead of overlapping it (the default-stream behaviour,
modelled as ``blocked``) the fraction would be about 0.5; a probe FAILs
below :data:`FLOOR` (0.75), halfway between that and perfect overlap and far
outside timing noise (about 0.02 at the probes' sizes). Everything here takes
numbers or a :class:`~mpstream.observe.timeline.Timeline`, so it is tested with
synthetic timelines.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from ..observe.timeline import Timeline
from .diagnosis import FAIL, PASS, Check

__all__ = ["TARGET", "FLOOR", "MIN_STAGE_MS", "Overlap", "timeline_overlap", "size_copy"]

TARGET = 0.9
FLOOR = 0.75
MIN_STAGE_MS = 0.25  # shorter tasks would measure host issue cost, not overlap


@dataclass
class Overlap:
    """One probe's times (milliseconds) and what they mean."""

    name: str
    measured_ms: float
    serial_ms: float
    ideal_ms: float
    blocked_ms: float | None = None
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def fraction(self) -> float | None:
        """``(serial - measured) / (serial - ideal)``; None if no overlap is possible."""
        gap = self.serial_ms - self.ideal_ms
        return (self.serial_ms - self.measured_ms) / gap if gap > 0 else None

    @property
    def blocked_fraction(self) -> float | None:
        """The fraction copies serialised with compute would score."""
        gap = self.serial_ms - self.ideal_ms
        if self.blocked_ms is None or gap <= 0:
            return None
        return (self.serial_ms - self.blocked_ms) / gap

    def check(self, target: float = TARGET, floor: float = FLOOR) -> Check:
        """PASS at or above ``floor`` (noting whether ``target`` is met), else FAIL."""
        f = self.fraction
        times = (
            f"measured {self.measured_ms:.2f} ms, serial {self.serial_ms:.2f} ms, "
            f"ideal {self.ideal_ms:.2f} ms"
        )
        data = {
            "measured_ms": self.measured_ms,
            "serial_ms": self.serial_ms,
            "ideal_ms": self.ideal_ms,
            "blocked_ms": self.blocked_ms,
            "fraction": f,
            "blocked_fraction": self.blocked_fraction,
            **self.data,
        }
        if f is None:
            return Check(self.name, FAIL, f"no overlap possible at these sizes ({times})", data)
        if f > 1.1:
            # Faster than perfect overlap: the calibration, not the pipeline, is off.
            return Check(self.name, FAIL, f"fraction {f:.2f} > 1: calibration off ({times})", data)
        note = "meets" if f >= target else "below"
        status = PASS if f >= floor else FAIL
        return Check(self.name, status, f"fraction {f:.2f} ({note} {target}; {times})", data)


def timeline_overlap(
    name: str, timeline: Timeline, ideal_ms: float, blocked_ms: float | None = None
) -> Overlap:
    """An :class:`Overlap` from a timeline: the median run's makespan against
    the median sum of its task durations."""
    runs = timeline.runs()
    if not runs:
        raise ValueError("the timeline is empty: nothing was recorded")
    makespans, serials = [], []
    for r in runs:
        spans = [s for s in timeline.spans if s.run == r]
        makespans.append(max(s.end_ms for s in spans) - min(s.start_ms for s in spans))
        serials.append(sum(s.duration_ms for s in spans))
    return Overlap(
        name, statistics.median(makespans), statistics.median(serials), ideal_ms, blocked_ms
    )


def size_copy(
    bytes_per_ms: float, stage_ms: float, cap_bytes: int, min_stage_ms: float = MIN_STAGE_MS
) -> tuple[int, float]:
    """Bytes per copy and stage time so that a copy takes as long as a stage.

    A copy of ``stage_ms`` at ``bytes_per_ms``, at most ``cap_bytes``; when
    the cap binds, stages shrink to the copy's time (not below
    ``min_stage_ms``).

    Returns:
        (bytes per copy, a multiple of 4; stage time in ms).
    """
    if bytes_per_ms <= 0 or stage_ms <= 0:
        raise ValueError("bandwidth and stage time must be positive")
    wanted = bytes_per_ms * stage_ms
    size = int(min(wanted, cap_bytes)) // 4 * 4
    stage = stage_ms if wanted <= cap_bytes else max(size / bytes_per_ms, min_stage_ms)
    return max(size, 4), stage

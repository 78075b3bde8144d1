"""``schedule="auto"``: what a Pipe is asked to choose, and the report of its choice.

An :class:`Auto` (or the string ``"auto"``, an ``Auto()``) asks a
:class:`~mpstream.Pipe` to run the built-in schedule that fits its placement
and has the shortest simulated step, under an optional budget of
activation memory per device. The choice is plain data here: each
:class:`Candidate`'s simulated step and peak activation memory, and
:func:`pick`, which keeps the fastest within the budget. The simulation
itself, and the costs it is fed (given, cached or profiled), belong to the
tools (:mod:`mpstream.observe`), which the Pipe reaches through a hook
(:mod:`mpstream.pipe.auto`). The budget is checked against
:func:`~mpstream.schedules.slots.peak_activations`: from a schedule's issue
order, the most bytes each device holds for backward at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .._words import count_of

__all__ = ["Auto", "Candidate", "ScheduleReport", "pick"]


def _numbers(values: Sequence[float], what: str) -> tuple[float, ...]:
    out = tuple(float(v) for v in values)
    if not all(math.isfinite(v) and v >= 0 for v in out):
        raise ValueError(f"{what} must be finite and not negative, got {list(values)}")
    return out


@dataclass(frozen=True)
class Auto:
    """``schedule=Auto(...)``: pick a built-in schedule at the first ``train_step``.

    Args:
        memory_budget: bytes of activations each device may hold for
            backward at once (None: no limit). Checked against the peak the
            schedule's issue order predicts from each stage's bytes per
            micro-batch.
        costs: per stage, (forward, input_grad, weight_grad) milliseconds
            per micro-batch; None measures them (the tuning cache, else a
            profile of a few steps).
        activation_bytes: per stage, the bytes one micro-batch saves for
            backward; None measures them (one fill-drain step) when
            ``memory_budget`` is given.
        cache: the JSON file the measured costs are kept in, keyed by
            model, devices, batch and torch (``mpstream.tune``'s cache,
            ``'default'``), or None for none.

    Raises:
        ValueError: a negative or non-finite budget, cost or byte count, or
            costs that are not triples.
    """

    memory_budget: float | None = None
    # Sequences as given; kept as tuples (hashable, and safe from later edits).
    costs: Sequence[tuple[float, float, float]] | None = None
    activation_bytes: Sequence[float] | None = None
    cache: str | None = "default"

    def __post_init__(self) -> None:
        if self.memory_budget is not None:
            _numbers([self.memory_budget], "memory_budget")
        if self.costs is not None:
            triples = []
            for i, c in enumerate(self.costs):
                if len(c) != 3:
                    raise ValueError(
                        f"costs[{i}] must be a (forward, input_grad, weight_grad) triple of "
                        f"milliseconds, got {c!r}"
                    )
                f, b, w = _numbers(c, f"costs[{i}]")
                triples.append((f, b, w))
            object.__setattr__(self, "costs", tuple(triples))
        if self.activation_bytes is not None:
            object.__setattr__(
                self, "activation_bytes", _numbers(self.activation_bytes, "activation_bytes")
            )


@dataclass(frozen=True)
class Candidate:
    """One schedule that fits the placement, simulated.

    Attributes:
        schedule: its name.
        virtual_stages: stages per rank it runs with.
        step_ms: the simulated step.
        peak_bytes: per device, the most activation bytes held at once
            (empty when no bytes were known).
        within_budget: whether every device's peak fits the budget.
    """

    schedule: str
    virtual_stages: int
    step_ms: float
    peak_bytes: Mapping[str, float] = field(default_factory=dict)
    within_budget: bool = True


def pick(candidates: Sequence[Candidate], checkpoint: str = "never") -> Candidate:
    """The fastest candidate within the budget; among equal steps (to a
    millionth), the one holding the fewest activation bytes on its
    fullest device, then the earlier one (the simpler schedule, in
    ``SCHEDULES`` order).

    Args:
        candidates: the schedules simulated.
        checkpoint: the pipe's checkpoint mode, for the advice when none
            fits (checkpointing more only where some is left to add).

    Returns:
        The chosen candidate.

    Raises:
        ValueError: no candidate fits the budget (the message lists each
            one's peak).
    """
    fitting = [c for c in candidates if c.within_budget]
    if not fitting:
        peaks = "; ".join(
            f"{c.schedule}: {_size(max(c.peak_bytes.values(), default=0))}" for c in candidates
        )
        raise ValueError(
            f"no schedule keeps its activations within the memory budget (most held on one "
            f"device: {peaks}); raise Auto(memory_budget=...), "
            + ("" if checkpoint == "always" else "checkpoint more (checkpoint='always') ")
            + "or use more, smaller micro-batches"
        )
    best = min(c.step_ms for c in fitting)
    tied = [c for c in fitting if c.step_ms <= best * (1 + 1e-6)]
    return min(tied, key=lambda c: max(c.peak_bytes.values(), default=0.0))


@dataclass(frozen=True)
class ScheduleReport:
    """What ``schedule="auto"`` chose and why (``pipe.schedule_report()``).

    Attributes:
        chosen: the schedule the training steps run.
        virtual_stages: stages per rank it runs with.
        micros: the micro-batch count it was chosen for.
        candidates: every schedule that fits the placement, simulated.
        excluded: (schedule, why) for those that do not fit.
        costs: per stage, the (forward, input_grad, weight_grad) costs simulated.
        source: where the costs came from.
        memory_budget: the budget per device (None: none).
    """

    chosen: str
    virtual_stages: int
    micros: int
    candidates: tuple[Candidate, ...]
    excluded: tuple[tuple[str, str], ...]
    costs: tuple[tuple[float, float, float], ...]
    source: str
    memory_budget: float | None = None

    def __str__(self) -> str:
        budget = (
            "no memory budget"
            if self.memory_budget is None
            else f"a budget of {_size(self.memory_budget)} of activations per device"
        )
        micros = count_of(self.micros, "micro-batch", "micro-batches")
        lines = [
            f"schedule='auto' chose {self.chosen!r} for {micros}: the "
            f"shortest simulated step among the schedules that fit the placement, with "
            f"{budget}; costs: {self.source}",
            "",
            "| schedule | simulated step (ms) | peak activations per device | fits |",
            "| --- | ---: | --- | --- |",
        ]
        for c in self.candidates:
            peaks = ", ".join(f"{d}: {_size(b)}" for d, b in c.peak_bytes.items()) or "-"
            mark = " (chosen)" if c.schedule == self.chosen else ""
            fits = "yes" if c.within_budget else "over budget"
            lines.append(f"| {c.schedule}{mark} | {c.step_ms:.3f} | {peaks} | {fits} |")
        for name, why in self.excluded:
            lines.append(f"| {name} | - | - | no: {why} |")
        return "\n".join(lines)


def _size(n: float) -> str:
    """Bytes in the largest unit that keeps a number of at least 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"

"""Issue orders written by hand: the text form of a schedule, and its checks.

An order is the sequence of compute actions one host thread issues, one per
task: ``F0m3`` forwards micro-batch 3 through stage 0, ``B1m2`` back-propagates
micro-batch 2 through stage 1, and ``W1m2`` computes stage 1's parameter
gradients of micro-batch 2 after that ``B`` (which then computes only the
gradients of the stage's inputs; without a ``W``, ``B`` is the whole
backward). Copies between devices are implied: the schedule builder issues
them around the compute. Every built-in schedule prints in this form
(``str(schedule)``), so a researcher can start from one and edit it.

:func:`check` accepts an order only if every forward and backward of every
stage and micro-batch appears exactly once (weight actions at most once) and
each action comes after the actions it depends on; otherwise it raises
``ValueError`` with a stage x step grid of the order, the offending action
marked.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .. import _ext
from .._words import count_of

__all__ = ["Action", "KINDS", "parse", "is_order", "format_order", "grid", "check"]

_C = _ext.load()

# Letters of the text form, and the C++ task kinds they stand for.
KINDS = {"F": "forward", "B": "backward", "W": "weight"}
_PATTERN = re.compile(r"([FBW])(\d+)m(\d+)")
_CELLS_PER_BLOCK = 24  # grid columns per block of lines


@dataclass(frozen=True)
class Action:
    """One compute task of an order.

    Attributes:
        kind: ``'F'`` (forward), ``'B'`` (backward, or the input-gradient
            pass when a ``'W'`` of the same stage and micro-batch follows) or
            ``'W'`` (the parameter-gradient pass).
        stage: the stage.
        micro: the micro-batch.
    """

    kind: str
    stage: int
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}m{self.micro}"

    @property
    def native(self) -> tuple[object, int, int]:
        """The (kind, stage, micro) tuple the C++ core takes."""
        return (getattr(_C.Kind, KINDS[self.kind]), self.stage, self.micro)

    @classmethod
    def parse(cls, text: str) -> Action:
        """Reads one action, e.g. ``'F0m3'``.

        Raises:
            ValueError: ``text`` is not an action.
        """
        match = _PATTERN.fullmatch(text.strip())
        if match is None:
            raise ValueError(
                f"{text!r} is not a schedule action: write F, B or W, the stage, 'm' and the "
                f"micro-batch, e.g. 'F0m3' (forward of micro-batch 3 on stage 0)"
            )
        return cls(match.group(1), int(match.group(2)), int(match.group(3)))


def is_order(value: object) -> bool:
    """Whether ``value`` is meant as an order rather than a schedule's name:
    a list or tuple, or a string holding several words (separated as
    :func:`parse` reads them: whitespace or commas)."""
    if isinstance(value, str):
        return len(value.replace(",", " ").split()) > 1
    return isinstance(value, (list, tuple))


def parse(order: str | Sequence[str | Action]) -> tuple[Action, ...]:
    """The actions of an order given as text (whitespace or commas between
    actions) or as a sequence of action strings.

    Raises:
        ValueError: an item is not an action, or the order is empty.
        TypeError: an item is neither a string nor an :class:`Action`.
    """
    items: Sequence[str | Action] = (
        order.replace(",", " ").split() if isinstance(order, str) else order
    )
    out = []
    for item in items:
        if isinstance(item, Action):
            out.append(item)
        elif isinstance(item, str):
            out.append(Action.parse(item))
        else:
            raise TypeError(
                f"a schedule order lists actions as strings like 'F0m3', got {type(item).__name__}"
            )
    if not out:
        raise ValueError("the schedule order is empty")
    return tuple(out)


def format_order(actions: Sequence[Action]) -> str:
    """The text form: actions separated by spaces (what :func:`parse` reads)."""
    return " ".join(str(a) for a in actions)


def grid(actions: Sequence[Action], stages: int, mark: int | None = None) -> str:
    """The order as a stage x step table: each action sits in its stage's row
    and its step's column, shown as kind and micro-batch (``F3``); the action
    at step ``mark`` is bracketed. Long orders wrap into blocks of steps."""
    rows = max(stages, 1 + max((a.stage for a in actions), default=-1))
    cells = [f"{a.kind}{a.micro}" for a in actions]
    width = 2 + max((len(c) for c in cells), default=2)
    label = max(len(f"stage {rows - 1}"), len("step"))
    lines: list[str] = []
    for start in range(0, len(actions), _CELLS_PER_BLOCK):
        steps = range(start, min(start + _CELLS_PER_BLOCK, len(actions)))
        if lines:
            lines.append("")
        lines.append(("step".ljust(label) + "".join(str(i).center(width) for i in steps)).rstrip())
        for s in range(rows):
            line = f"stage {s}".ljust(label)
            for i in steps:
                text = cells[i] if actions[i].stage == s else ""
                if i == mark and text:
                    text = f"[{text}]"
                line += text.center(width)
            lines.append(line.rstrip())
    return "\n".join(lines)


def check(
    actions: Sequence[Action], stages: int, micros: int, reads: Sequence[Sequence[int]]
) -> None:
    """Checks that one host thread can issue ``actions`` in order.

    Args:
        actions: the order.
        stages: the pipeline's stages.
        micros: the step's micro-batches.
        reads: per stage, the stages it reads (-1: the input).

    Raises:
        ValueError: the order leaves out a stage, covers another number of
            micro-batches, misses or repeats an action, or issues an action before one it depends
            on; the message holds the stage x step grid of the order with the
            offending action marked.
    """
    outside = next((a for a in actions if not 0 <= a.stage < stages), None)
    if outside is not None:
        raise ValueError(
            f"invalid schedule order: {outside} names no stage {outside.stage} (stages "
            f"0-{stages - 1})"
        )
    # Named here, not as the first action needing one (an order written for
    # fewer stages would read as "B2m0 needs B3m0").
    named = {a.stage for a in actions}
    missing = [s for s in range(stages) if s not in named]
    if missing:
        raise ValueError(
            f"the schedule order has no action of stage {', '.join(map(str, missing))}, but "
            f"the run has {count_of(stages, 'stage')} (0-{stages - 1}), each forwarding and "
            f"back-propagating every micro-batch: give an order for {count_of(stages, 'stage')}, "
            f"or a pipe of the stages the order covers"
        )
    covered = 1 + max(a.micro for a in actions)
    if covered != micros:
        raise ValueError(
            f"the schedule order covers {covered} micro-batch(es) (m0-m{covered - 1}) but "
            f"the run has {micros} (a pipe's: what chunks= or split_size= makes of the "
            f"batch, torch.chunk making fewer than chunks where the batch is short); give an "
            f"order for {micros}, or a run of {count_of(covered, 'micro-batch', 'micro-batches')}"
        )
    step, problem = _C.check_order(micros, [list(r) for r in reads], [a.native for a in actions])
    if problem:
        where = f"; [ ] marks step {step}" if step >= 0 else ""
        raise ValueError(
            f"invalid schedule order: {problem}\n"
            f"stage x step grid of the order (kind and micro-batch{where}):\n"
            f"{grid(actions, stages, step if step >= 0 else None)}"
        )

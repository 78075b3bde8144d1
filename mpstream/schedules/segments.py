"""Segments: a step's order cut into runs of one group of stages each.

A CUDA graph lives on one device, so a training step captured across
devices is several graphs. One graph per device does not work: within a
step the dependencies go both ways (activations forward, gradients back),
and a graph can only wait on work launched before it (an event wait binds
to the latest record issued when the graph is launched). So the step is
cut into *segments*: runs of consecutive actions of one *group* (the
stages captured together, e.g. those on one device), each reading only what
its own segment or an earlier one produced. Launched in order, every wait
refers to work already issued, and the host issues one launch per segment
instead of every kernel. Segments of different groups still overlap on the
devices: a segment's first action waits for the one action it reads, not
for the whole segment before it.

:func:`segment` reorders a schedule into as few segments as a greedy pass
finds, keeping each stage's own order (so each stage's memory bound stays
the schedule's); the result is an order like any other, which
``Schedule(format_order(segments.order), ...)`` and ``Pipe(schedule=...)``
accept. Fill-drain on two devices needs 3 segments (forwards of the first
device, the second device's forwards and backwards, the first device's
backwards); 1F1B needs about one per micro-batch and device. Nothing here
needs a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .orders import Action, format_order
from .schedule import Kind, Schedule, Task

__all__ = ["Segment", "Segments", "segment", "action_of"]

_LETTER = {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.WEIGHT: "W"}


@dataclass(frozen=True)
class Segment:
    """Consecutive actions of one group: what one graph launch would run.

    Attributes:
        group: the group whose stages run the actions.
        actions: the actions, in issue order.
    """

    group: int
    actions: tuple[Action, ...]

    def __str__(self) -> str:
        return f"g{self.group}[{format_order(self.actions)}]"


@dataclass(frozen=True)
class Segments:
    """A schedule cut into segments, in launch order.

    Attributes:
        parts: the segments, in the order they must be launched.
        waits: every dependency that crosses segments, as (producer,
            consumer) actions: what the consumer's graph waits on with an
            event the producer's graph records.
    """

    parts: tuple[Segment, ...]
    waits: tuple[tuple[Action, Action], ...]

    @property
    def order(self) -> tuple[Action, ...]:
        """Every action in launch order: a valid schedule order."""
        return tuple(a for part in self.parts for a in part.actions)

    @property
    def launches(self) -> int:
        """Graph launches per step: one per segment."""
        return len(self.parts)

    @property
    def events(self) -> int:
        """Producers whose completion another segment waits on (one event each)."""
        return len({p for p, _ in self.waits})

    def __str__(self) -> str:
        return " | ".join(map(str, self.parts))


def action_of(task: Task) -> Action | None:
    """The compute action a task is (None for copies and transfers)."""
    letter = _LETTER.get(task.kind)
    return None if letter is None else Action(letter, task.stage, task.micro)


def _compute_deps(schedule: Schedule) -> dict[int, set[int]]:
    """For each compute task, the compute tasks it reads, looking through the
    copies and transfers between them."""
    through: dict[int, set[int]] = {}
    out: dict[int, set[int]] = {}
    for t in schedule.tasks:  # deps come before their readers
        reached: set[int] = set()
        for d in t.deps:
            if schedule.tasks[d].kind in _LETTER:
                reached.add(d)
            else:
                reached |= through[d]
        if t.kind in _LETTER:
            out[t.index] = reached
        else:
            through[t.index] = reached
    return out


def segment(schedule: Schedule, groups: Sequence[int] | None = None) -> Segments:
    """Cuts ``schedule`` into segments of one group each.

    Each round takes the first action not yet placed (always ready: what it
    reads comes before it in the schedule) and, for its group, every action
    that is ready in the schedule's order: what it reads is placed, and so
    is every earlier action of its stage. Consecutive segments therefore
    belong to different groups.

    Args:
        schedule: any schedule with its compute actions (built-in or an
            explicit order).
        groups: a group label per stage (stages with equal labels are
            captured together); by default the schedule's device labels.

    Returns:
        The segments in launch order, and the waits between them.

    Raises:
        ValueError: ``groups`` does not hold one label per stage.
    """
    labels = list(schedule.topology.devices if groups is None else groups)
    if len(labels) != schedule.stages:
        raise ValueError(f"groups needs one label per stage ({schedule.stages}), got {len(labels)}")
    deps = _compute_deps(schedule)
    action = {t.index: a for t in schedule.tasks if (a := action_of(t)) is not None}
    before: dict[int, int] = {}  # a compute task -> the previous one of its stage
    last: dict[int, int] = {}
    for i in action:
        s = schedule.tasks[i].stage
        if s in last:
            before[i] = last[s]
        last[s] = i
    placed: dict[int, int] = {}  # task -> its segment
    remaining = list(action)
    parts: list[Segment] = []

    def ready(i: int) -> bool:
        prev = before.get(i)
        return (prev is None or prev in placed) and all(d in placed for d in deps[i])

    while remaining:
        group = labels[schedule.tasks[remaining[0]].stage]
        taken: list[int] = []
        for i in remaining:
            # One pass suffices: what an action waits for comes before it.
            if labels[schedule.tasks[i].stage] == group and ready(i):
                placed[i] = len(parts)
                taken.append(i)
        parts.append(Segment(group, tuple(action[i] for i in taken)))
        done = set(taken)
        remaining = [i for i in remaining if i not in done]
    # ``placed`` lists the actions in launch order.
    waits = tuple(
        (action[d], action[i])
        for i, part in placed.items()
        for d in sorted(deps[i])
        if placed[d] != part
    )
    return Segments(tuple(parts), waits)

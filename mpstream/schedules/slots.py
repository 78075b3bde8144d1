"""Graph slots: which micro-batches of a stage may share one set of graphs.

A stage replayed from CUDA graphs keeps a micro-batch's activations in the
graphs' memory from its forward until its backward (and, when a zero-bubble
schedule splits it, its weight pass) has run. A second forward replayed
into the same graphs before then would overwrite what that backward reads.
So each stage gets as many *slots* (sets of graphs) as the schedule keeps
micro-batches in flight on it: fill-drain all of them, 1F1B at most its
warm-up depth, a forward-only run one.

:func:`plan_slots` assigns every micro-batch a slot from the schedule's task
order alone, and :func:`check_slots` proves an assignment safe: no slot
takes a new forward while an earlier micro-batch in it still waits for its
backward. Nothing here needs a device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .schedule import Kind, Schedule, Task

__all__ = ["Slots", "Pass", "plan_slots", "check_slots", "lifetimes", "peak_activations"]

# A graphed pass of a stage: forward, backward (input gradients only where a
# weight pass follows), weight.
Pass = Kind


@dataclass(frozen=True)
class Slots:
    """The slot of every (stage, micro-batch) of one schedule.

    Attributes:
        slot: ``slot[(s, m)]``: which of stage ``s``'s slots micro-batch ``m``
            uses.
        counts: slots per stage (the most micro-batches in flight on it).
        order: the graphed passes ``(stage, slot, pass)`` in the order the
            schedule first runs them: the order to capture them in, so that
            graphs sharing a memory pool allocate in execution order.
    """

    slot: Mapping[tuple[int, int], int]
    counts: tuple[int, ...]
    order: tuple[tuple[int, int, Pass], ...]


def lifetimes(tasks: Sequence[Task], stages: int) -> dict[tuple[int, int], tuple[int, int]]:
    """For each (stage, micro-batch), the task positions its activations live
    between: its forward, and its last backward or weight pass (the forward
    itself in a forward-only schedule).

    Raises:
        ValueError: a backward or weight pass comes before its forward.
    """
    live: dict[tuple[int, int], tuple[int, int]] = {}
    for i, task in enumerate(tasks):
        key = (task.stage, task.micro)
        if task.kind is Kind.FORWARD:
            live[key] = (i, i)
        elif task.kind in (Kind.BACKWARD, Kind.WEIGHT):
            if key not in live:
                raise ValueError(
                    f"stage {task.stage} runs the {task.kind.label} pass of micro-batch "
                    f"{task.micro} before its forward"
                )
            live[key] = (live[key][0], i)
    missing = sorted({s for s, _ in live} - set(range(stages)))
    if missing:
        raise ValueError(f"the tasks name stages {missing} of a {stages}-stage pipeline")
    return live


def plan_slots(schedule: Schedule, *, backward_later: bool = False) -> Slots:
    """Assigns each micro-batch of each stage the lowest slot free at its forward.

    Greedy assignment in task order uses exactly as many slots as the most
    micro-batches alive at once (interval colouring), so slot memory is no
    larger than the schedule itself needs.

    Args:
        schedule: the schedule a run issues.
        backward_later: the backward runs after the whole schedule, outside
            it (``loss.backward()`` after ``pipe(x)``): every micro-batch of
            a forward-only schedule stays alive to the end.

    Returns:
        The slots, checked with :func:`check_slots`.
    """
    tasks = schedule.tasks
    live = lifetimes(tasks, schedule.stages)
    if backward_later:
        end = len(tasks)
        live = {key: (start, end) for key, (start, _) in live.items()}
    busy_until: dict[int, list[int]] = {s: [] for s in range(schedule.stages)}
    slot: dict[tuple[int, int], int] = {}
    order: list[tuple[int, int, Pass]] = []
    seen: set[tuple[int, int, Pass]] = set()
    for i, task in enumerate(tasks):
        key = (task.stage, task.micro)
        if task.kind is Kind.FORWARD:
            ends = busy_until[task.stage]
            free = next((k for k, until in enumerate(ends) if until < i), len(ends))
            if free == len(ends):
                ends.append(0)
            ends[free] = live[key][1]
            slot[key] = free
        if task.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT):
            graphed = (task.stage, slot[key], task.kind)
            if graphed not in seen:
                seen.add(graphed)
                order.append(graphed)
    counts = tuple(len(busy_until[s]) for s in range(schedule.stages))
    slots = Slots(slot, counts, tuple(order))
    check_slots(tasks, slots, backward_later=backward_later, stages=schedule.stages)
    return slots


def check_slots(
    tasks: Sequence[Task], slots: Slots, *, backward_later: bool = False, stages: int
) -> None:
    """Proves that no slot takes a forward while its previous micro-batch
    still waits for a backward or weight pass.

    Raises:
        ValueError: naming the stage, the slot, the micro-batch whose
            activations would be overwritten and the one that would overwrite
            them.
    """
    live = lifetimes(tasks, stages)
    end = len(tasks)
    holder: dict[tuple[int, int], int] = {}  # (stage, slot) -> micro-batch in it
    for i, task in enumerate(tasks):
        if task.kind is not Kind.FORWARD:
            continue
        s, m = task.stage, task.micro
        if (s, m) not in slots.slot:
            raise ValueError(f"micro-batch {m} of stage {s} has no slot")
        k = slots.slot[(s, m)]
        if not 0 <= k < slots.counts[s]:
            raise ValueError(f"stage {s} has {slots.counts[s]} slot(s); micro-batch {m} got {k}")
        before = holder.get((s, k))
        if before is not None:
            done = end if backward_later else live[(s, before)][1]
            if done > i:
                raise ValueError(
                    f"stage {s}, slot {k}: the forward of micro-batch {m} would overwrite the "
                    f"activations of micro-batch {before}, whose backward has not run yet"
                )
        holder[(s, k)] = m


def peak_activations(
    schedule: Schedule, stage_bytes: Sequence[float], devices: Sequence[str]
) -> dict[str, float]:
    """Per device, the most bytes its stages hold for backward at once.

    A micro-batch holds ``stage_bytes[s]`` on stage ``s`` over its
    :func:`lifetimes` (from its forward to its last backward pass there: W
    when the backward is split, until which it keeps what W reads, counted
    whole), in the schedule's issue order.

    Args:
        schedule: the schedule.
        stage_bytes: per stage, the bytes one micro-batch saves.
        devices: per stage, its device's label.

    Returns:
        Per device label, in the order of the stages.
    """
    change: dict[int, list[tuple[str, float]]] = {}
    for (s, _), (first, last) in lifetimes(schedule.tasks, schedule.stages).items():
        change.setdefault(first, []).append((devices[s], stage_bytes[s]))
        change.setdefault(last, []).append((devices[s], -stage_bytes[s]))
    now = dict.fromkeys(devices, 0.0)
    peak = dict(now)
    for i in sorted(change):
        for d, delta in sorted(change[i], key=lambda c: -c[1]):  # the new first, then the freed
            now[d] += delta
            peak[d] = max(peak[d], now[d])
    return peak

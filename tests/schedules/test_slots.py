"""Graph slots: as many per stage as micro-batches in flight, never reused early."""

from __future__ import annotations

import dataclasses

import pytest

from mpstream.schedules import SCHEDULES, Kind, Schedule, Topology, placement_of
from mpstream.schedules.slots import check_slots, lifetimes, plan_slots


def schedule(name: str, stages: int, micros: int) -> Schedule:
    if placement_of(name) == "round_robin":  # two ranks, stages round-robin over them
        devices = tuple(s % 2 for s in range(stages))
        return Schedule(
            name, stages, micros, Topology(_chain(stages), devices), virtual_stages=stages // 2
        )
    if placement_of(name) == "v":  # stages s and stages - 1 - s on rank s
        devices = tuple(min(s, stages - 1 - s) for s in range(stages))
        return Schedule(name, stages, micros, Topology(_chain(stages), devices), virtual_stages=2)
    return Schedule(name, stages, micros, Topology(_chain(stages), tuple(range(stages))), True)


def _chain(stages: int) -> tuple[tuple[int, ...], ...]:
    return tuple((s - 1,) for s in range(stages))


def in_flight(sched: Schedule) -> list[int]:
    """The most micro-batches alive at once on each stage, counted directly."""
    live = lifetimes(sched.tasks, sched.stages)
    return [
        max(
            sum(1 for (t, _), (a, b) in live.items() if t == s and a <= i <= b)
            for i in range(len(sched.tasks))
        )
        for s in range(sched.stages)
    ]


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("stages", "micros"), [(2, 4), (4, 8), (4, 3)])
def test_slots_per_stage_are_the_micro_batches_in_flight(
    name: str, stages: int, micros: int
) -> None:
    sched = schedule(name, stages, micros)
    slots = plan_slots(sched)
    assert list(slots.counts) == in_flight(sched)
    assert set(slots.slot) == {(s, m) for s in range(stages) for m in range(micros)}


def test_slot_counts_of_the_built_in_schedules() -> None:
    assert plan_slots(schedule("gpipe", 4, 8)).counts == (8, 8, 8, 8)  # fill-drain: all
    assert plan_slots(schedule("1f1b", 4, 8)).counts == (4, 3, 2, 1)  # stages - s
    assert plan_slots(schedule("1f1b", 4, 2)).counts == (2, 2, 2, 1)  # never more than micros
    zb = plan_slots(schedule("zb_h1", 4, 8)).counts  # weight passes wait: more than 1F1B
    assert all(z >= f for z, f in zip(zb, (4, 3, 2, 1)))


def test_a_forward_only_run_needs_one_slot_unless_backward_comes_later() -> None:
    forward = Schedule("gpipe", 3, 5, Topology(_chain(3), (0, 1, 2)))
    assert plan_slots(forward).counts == (1, 1, 1)
    # pipe(x) then loss.backward(): every micro-batch waits for the backward.
    assert plan_slots(forward, backward_later=True).counts == (5, 5, 5)


def test_capture_order_is_execution_order_of_each_graph() -> None:
    sched = schedule("1f1b", 2, 4)
    slots = plan_slots(sched)
    first = {}
    for i, task in enumerate(sched.tasks):
        if task.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT):
            first.setdefault((task.stage, slots.slot[(task.stage, task.micro)], task.kind), i)
    assert list(slots.order) == sorted(first, key=first.__getitem__)
    assert slots.order[0] == (0, 0, Kind.FORWARD)


def test_a_slot_reused_while_its_backward_is_pending_is_refused() -> None:
    sched = schedule("gpipe", 2, 3)
    slots = plan_slots(sched)
    # Fill-drain: micro-batch 1's forward runs before micro-batch 0's backward.
    squeezed = dict(slots.slot)
    squeezed[(0, 1)] = squeezed[(0, 0)]
    bad = dataclasses.replace(slots, slot=squeezed)
    with pytest.raises(
        ValueError,
        match="stage 0, slot 0: the forward of micro-batch 1 would "
        "overwrite the activations of micro-batch 0",
    ):
        check_slots(sched.tasks, bad, stages=2)


def test_a_forward_only_run_may_reuse_a_slot_but_not_before_a_later_backward() -> None:
    forward = Schedule("gpipe", 2, 3, Topology(_chain(2), (0, 1)))
    one = plan_slots(forward)
    check_slots(forward.tasks, one, stages=2)
    with pytest.raises(ValueError, match="backward has not run yet"):
        check_slots(forward.tasks, one, backward_later=True, stages=2)


def test_bad_assignments_are_named() -> None:
    sched = schedule("1f1b", 2, 2)
    slots = plan_slots(sched)
    missing = dataclasses.replace(slots, slot={k: v for k, v in slots.slot.items() if k != (1, 1)})
    with pytest.raises(ValueError, match="micro-batch 1 of stage 1 has no slot"):
        check_slots(sched.tasks, missing, stages=2)
    outside = dataclasses.replace(slots, slot={**slots.slot, (1, 1): 5})
    with pytest.raises(ValueError, match="stage 1 has 1 slot"):
        check_slots(sched.tasks, outside, stages=2)

"""Segments: every schedule cut into runs of one group, each reading only
what it or an earlier run produced; the reordered step trains like the
original one."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.schedules import SCHEDULES, Schedule, Topology, format_order, placement_of
from mpstream.schedules.segments import segment
from tests.helpers import assert_same_grads, mlp

UNET = Topology(((-1,), (0,), (0, 1), (0, 2)), (0, 1, 0, 1), -1)


def chain(devices: list[int]) -> Topology:
    return Topology(tuple((s - 1,) for s in range(len(devices))), tuple(devices), 0)


def build(name: str, topology: Topology, micros: int) -> Schedule:
    stages = topology.stages
    virtual = {"round_robin": 2, "v": 2}.get(placement_of(name))
    return Schedule(name, stages, micros, topology, backward=True, virtual_stages=virtual)


def test_fill_drain_on_two_devices_is_three_launches() -> None:
    cut = segment(build("gpipe", chain([0, 1]), 3))
    assert str(cut) == (
        "g0[F0m0 F0m1 F0m2] | g1[F1m0 F1m1 F1m2 B1m2 B1m1 B1m0] | g0[B0m2 B0m1 B0m0]"
    )
    assert cut.launches == 3
    # Device 1 waits on each forward, device 0 on each backward.
    assert [(str(p), str(c)) for p, c in cut.waits[:2]] == [("F0m0", "F1m0"), ("F0m1", "F1m1")]
    assert cut.events == 6


def test_one_f_one_b_alternates_about_once_per_micro_batch() -> None:
    cut = segment(build("1f1b", chain([0, 1]), 8))
    assert cut.launches == 9
    assert str(cut.parts[1]) == "g1[F1m0 B1m0 F1m1 B1m1]"
    assert {part.group for part in cut.parts[::2]} == {0}


def test_one_device_is_one_segment_and_groups_can_split_it() -> None:
    sched = build("1f1b", chain([0, 0]), 4)
    assert segment(sched).launches == 1
    assert segment(sched).order == sched.order  # nothing to reorder
    # Two stages on one GPU captured as two graphs: the measurable case.
    assert segment(sched, [0, 1]).launches == segment(build("1f1b", chain([0, 1]), 4)).launches
    with pytest.raises(ValueError, match="one label per stage \\(2\\), got 3"):
        segment(sched, [0, 1, 2])


LAYOUTS = {
    "two": chain([0, 1]),
    "four": chain([0, 1, 2, 3]),
    "pairs": chain([0, 0, 1, 1]),
    "round-robin": chain([0, 1, 0, 1]),
    "v": chain([0, 1, 1, 0]),
    "unet": UNET,
}
# The layouts each placement takes (a rank per stage: any).
PLACED = {"round_robin": ("round-robin", "unet"), "v": ("v",), "stage": tuple(LAYOUTS)}
CASES = [(name, layout) for name in SCHEDULES for layout in PLACED[placement_of(name)]]


@pytest.mark.parametrize(("name", "layout"), CASES)
@pytest.mark.parametrize("micros", [1, 2, 5])
def test_every_segment_reads_only_what_was_launched_before(
    name: str, layout: str, micros: int
) -> None:
    topology = LAYOUTS[layout]
    sched = build(name, topology, micros)
    cut = segment(sched)
    order = cut.order
    assert sorted(map(str, order)) == sorted(map(str, sched.order))
    for a, b in itertools.pairwise(cut.parts):
        assert a.group != b.group and a.actions and b.actions
    for part in cut.parts:
        assert {topology.devices[a.stage] for a in part.actions} == {part.group}
    # Each stage keeps its own order (and so its memory bound).
    for s in range(sched.stages):
        assert [a for a in order if a.stage == s] == [a for a in sched.order if a.stage == s]
    # The cut is a valid order (the C++ core checks every read) ...
    again = Schedule(format_order(order), sched.stages, micros, topology)
    assert again.order == order
    # ... and every wait across segments points back to an earlier launch.
    where = {a: i for i, part in enumerate(cut.parts) for a in part.actions}
    assert all(where[p] < where[c] for p, c in cut.waits)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1"])
def test_the_segmented_order_trains_like_the_schedule(name: str) -> None:
    model = mlp([5, 8, 7, 6, 4])
    ref = copy.deepcopy(model)
    sched = build(name, chain([0, 1, 2]), 3)
    order = format_order(segment(sched).order)
    assert order != str(sched)
    pipe = Pipe(model, chunks=3, balance=[2, 2, 4], devices=["cpu"] * 3, schedule=order)
    x = torch.randn(7, 5, dtype=torch.float64)  # 3 + 3 + 1: a smaller last micro-batch
    y = torch.randn(7, 4, dtype=torch.float64)
    loss = pipe.train_step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)

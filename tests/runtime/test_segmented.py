"""Segmented runs: a step issued as one graph per segment. The plan obeys
the capture rules (waits only within a segment, external events across,
every stream joined before a segment ends); the step trains like the
schedule; failures leave nothing half-done."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.runtime import EventScheduler
from mpstream.runtime.plan import PlanError, record_plan, verify_plan
from mpstream.runtime.segmented import HostEdges, Segmenting
from mpstream.runtime.stream import AnyStream
from mpstream.schedules import SCHEDULES, Schedule, Topology, placement_of
from mpstream.schedules.segments import segment
from tests.helpers import assert_same_grads, mlp

TWO = ["cuda:0", "cuda:1"]
ROUND = ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
V = ["cuda:0", "cuda:1", "cuda:1", "cuda:0"]

# (devices, groups, force copies): two GPUs; two and four groups on one GPU
# (the measurable case: stages on one device captured as separate graphs).
LAYOUTS = {
    "two devices": (TWO, [0, 1], False),
    "round-robin": (ROUND, [0, 1, 0, 1], False),
    "v": (V, [0, 1, 1, 0], False),
    "one device, two groups": (["cuda:0"] * 2, [0, 1], True),
    "one device, four groups": (["cuda:0"] * 4, [0, 1, 2, 3], True),
}


def plan(name: str, layout: str, micros: int):  # type: ignore[no-untyped-def]
    devices, groups, force = LAYOUTS[layout]
    one = len(set(devices)) == 1  # then virtual_stages gives the ranks
    virtual = 2 if placement_of(name) != "stage" and (one or layout == "v") else None
    return record_plan(
        name,
        len(devices),
        micros,
        devices,
        backward=True,
        force_copies=force,
        groups=groups,
        virtual_stages=virtual,
    )


# The layouts each placement takes: round-robin schedules four stages
# round-robin or on one device, V ones a V or one device.
PLACED = {
    "stage": ("two devices", "round-robin", "one device, two groups", "one device, four groups"),
    "round_robin": ("round-robin", "one device, four groups"),
    "v": ("v", "one device, two groups", "one device, four groups"),
}
CASES = [(name, layout) for name in SCHEDULES for layout in PLACED[placement_of(name)]]


@pytest.mark.parametrize(("name", "layout"), CASES)
@pytest.mark.parametrize("micros", [1, 3, 5])
def test_segmented_plans_obey_the_capture_rules(name: str, layout: str, micros: int) -> None:
    recorded = plan(name, layout, micros)
    verify_plan(recorded)
    ops = [op.op for op in recorded.ops]
    assert ops.count("begin_segment") == ops.count("end_segment") > 0
    waits = {op.event for op in recorded.ops if op.op == "xwait"}
    records = {op.event for op in recorded.ops if op.op == "xrecord"}
    assert waits <= records


@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_only_waits_across_groups_are_external(name: str) -> None:
    # A group's segments launch one after another on its stream: what one
    # reads from an earlier one of its group needs no external event.
    recorded = plan(name, "one device, two groups", 5)
    group_of: dict[int, int] = {}
    task_group: dict[int, int] = {}
    group = -1
    for op in recorded.ops:
        if op.op == "begin_segment":
            group = group_of[op.event] = op.stage
        elif op.op == "run" and op.task >= 0:
            task_group[op.task] = group
        elif op.op == "xwait":
            assert task_group[op.event] != group, f"task {op.event} is of this group"
    assert set(group_of.values()) == {0, 1}
    if name != "zb_h1":
        return
    # Without the order of a group's segments, the plan no longer holds: a
    # weight pass follows its input pass in a later segment of its group.
    unordered = [op._replace(stage=-1) if op.op == "begin_segment" else op for op in recorded.ops]
    with pytest.raises(PlanError, match="is not ordered after"):
        verify_plan(replace(recorded, ops=unordered))


def test_fill_drain_on_two_devices_is_three_segments() -> None:
    recorded = plan("gpipe", "two devices", 4)
    begins = [op for op in recorded.ops if op.op == "begin_segment"]
    assert [recorded.slot_names[op.slot] for op in begins] == [
        "caller@cuda:0",
        "caller@cuda:1",
        "caller@cuda:0",
    ]


def test_verify_plan_catches_each_broken_rule() -> None:
    good = plan("1f1b", "one device, two groups", 4)
    ops = good.ops

    def broken(new_ops):  # type: ignore[no-untyped-def]
        with pytest.raises(PlanError) as info:
            verify_plan(replace(good, ops=new_ops))
        return str(info.value)

    # No external waits: readers run before what they read.
    assert "is not ordered after" in broken([op for op in ops if op.op != "xwait"])
    # A segment's caller not waiting on its streams: the capture cannot end.
    ends = [i for i, op in enumerate(ops) if op.op == "end_segment"]
    unjoined = [op for i, op in enumerate(ops) if not (op.op == "wait" and i + 1 in ends)]
    assert "is not joined into caller@cuda:0 before the segment ends" in broken(unjoined)
    # A plain wait on an event of an earlier segment (another graph's).
    first = next(i for i, op in enumerate(ops) if op.op == "xwait")
    begin = max(i for i in range(first) if ops[i].op == "begin_segment")
    since = {op.event for op in ops[begin:first] if op.op == "record"}
    early = next(op.event for op in ops[:begin] if op.op == "record" and op.event not in since)
    crossed = list(ops)
    crossed[first] = ops[first]._replace(op="wait", event=early)
    assert "recorded in another segment" in broken(crossed)
    # An external wait with no earlier record.
    orphan = [op for op in ops if op.op != "xrecord"]
    assert "no earlier segment recorded" in broken(orphan)
    # A stream used in a segment before it joined it (its wait on the
    # segment's source moved after its first run).
    begins = [i for i, op in enumerate(ops) if op.op == "begin_segment"]
    second = begins[1]
    fork = next(i for i in range(second, len(ops)) if ops[i].op == "wait")
    run = next(i for i in range(fork, len(ops)) if ops[i].op == "run")
    late = [*ops[:fork], *ops[fork + 1 : run + 1], ops[fork], *ops[run + 1 :]]
    assert "before it joined the segment" in broken(late)


def test_groups_must_not_span_devices() -> None:
    sched = EventScheduler([torch.device(d) for d in TWO], virtual=True)
    schedule = Schedule("gpipe", 2, 2, Topology.chain([False, True]), backward=True)
    with pytest.raises(ValueError, match=r"stages 0 \(cuda:0\) and 1 \(cuda:1\) in one group"):
        Segmenting([0, 0], HostEdges()).issue(sched, schedule)


def test_a_step_in_segments_runs_on_one_kind_of_device() -> None:
    # Segments are captured as CUDA graphs; CPU stages have none to join.
    sched = EventScheduler([torch.device("cpu"), torch.device("cuda:0")], virtual=True)
    schedule = Schedule("gpipe", 2, 2, Topology.chain([False, True]), backward=True)
    with pytest.raises(ValueError, match="this pipe's stages are on cpu and cuda"):
        Segmenting([0, 1], HostEdges()).issue(sched, schedule)


class Recorded(HostEdges):
    """Edges that log what a capture would do."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def open(self, segment: int, group: int, device: torch.device) -> AnyStream | None:
        self.log.append(("open", group))
        return None

    def close(self, segment: int) -> None:
        self.log.append(("close", segment))

    def record(self, task: int, stream: AnyStream | None) -> None:
        self.log.append(("record", task))

    def wait(self, task: int, stream: AnyStream | None) -> None:
        self.log.append(("wait", task))

    def done(self) -> None:
        self.log.append(("done", -1))

    def abandon(self) -> None:
        self.log.append(("abandon", -1))


def data(n: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 5, dtype=torch.float64), torch.randn(n, 4, dtype=torch.float64)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_a_segmented_step_trains_like_the_schedule(name: str, checkpoint: str) -> None:
    model = mlp([5, 8, 7, 6, 4])
    ref = copy.deepcopy(model)
    pipe = Pipe(
        model,
        chunks=3,
        balance=[2, 2, 2, 2],
        devices=["cpu"] * 4,
        schedule=name,
        checkpoint=checkpoint,
        **({"virtual_stages": 2} if placement_of(name) != "stage" else {}),
    )
    x, y = data()  # 3 + 3 + 1: a smaller last micro-batch
    edges = Recorded()
    groups = {"round_robin": [0, 1, 0, 1], "v": [0, 1, 1, 0]}.get(placement_of(name), [0, 1, 2, 3])
    with pipe.segmented(groups, edges):
        loss = pipe.train_step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)
    opens = [g for what, g in edges.log if what == "open"]
    assert len(opens) == edges.log.count(("close", len(opens) - 1)) + len(opens) - 1
    recorded = [t for what, t in edges.log if what == "record"]
    for what, task in edges.log:
        if what == "wait":
            assert task in recorded  # recorded by an earlier segment
    assert pipe.__dict__["_segmenting"] is None


def test_a_failed_segmented_step_leaves_nothing_open() -> None:
    model = mlp([5, 8, 4])
    pipe = Pipe(model, chunks=2, balance=[2, 2], devices=["cpu"] * 2, schedule="1f1b")
    x, y = data(4)
    edges = Recorded()

    def failing(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("loss failed")

    with pipe.segmented([0, 1], edges):
        with pytest.raises(RuntimeError, match="loss failed"):
            pipe.train_step(x, y, failing)
        assert edges.log[-1] == ("abandon", -1)
        assert all(p.grad is None for p in pipe.parameters())
        pipe.train_step(x, y, nn.MSELoss())  # the next step works
        with pytest.raises(RuntimeError, match="already segmented"):
            with pipe.segmented():
                pass
    assert not pipe.scheduler.native.running
    pipe.train_step(x, y, nn.MSELoss())


def test_the_segments_are_the_planners() -> None:
    pipe = Pipe(mlp([5, 8, 4]), chunks=4, balance=[1, 3], devices=["cpu"] * 2, schedule="1f1b")
    edges = Recorded()
    x, y = data(8)
    with pipe.segmented([0, 1], edges):
        pipe.train_step(x, y, nn.MSELoss())
    cut = segment(pipe.schedule_for(4, x.device, training_step=True), [0, 1])
    assert [g for what, g in edges.log if what == "open"] == [p.group for p in cut.parts]


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1"])
def test_a_segmented_step_on_one_gpu_without_captures_trains_like_the_model(name: str) -> None:
    model = mlp([5, 8, 7, 4]).cuda()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=3, balance=[2, 4], devices=["cuda:0"] * 2, schedule=name)
    x, y = (t.cuda() for t in data())
    with pipe.segmented([0, 1]):
        loss = pipe.train_step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)


def test_a_failed_segment_is_joined_into_its_capturing_stream() -> None:
    """Before the edges end a failed segment's capture, the scheduler joins
    the failed task's stream into the segment's caller slot: a capture ends
    only joined (unjoined, it fails to end and leaves streams capturing)."""
    pipe = Pipe(mlp([5, 8, 4]), chunks=2, balance=[2, 2], devices=["cpu"] * 2, schedule="1f1b")
    x, y = data(4)
    sched = pipe.scheduler
    sched.recording = True

    def failing(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("loss failed")

    class Abandoning(Recorded):
        def abandon(self) -> None:
            self.log.append(("abandon", int(sched.native.running)))

    edges = Abandoning()
    with pipe.segmented([0, 1], edges):
        with pytest.raises(RuntimeError, match="loss failed"):
            pipe.train_step(x, y, failing)
    assert edges.log[-1] == ("abandon", 0), "the scheduler joined and ended the run first"
    ops = sched.plan()
    sched.recording = False
    begin = max(i for i, op in enumerate(ops) if op.op == "begin_segment")
    caller = ops[begin].slot
    failed = max(i for i, op in enumerate(ops) if op.op == "run")
    assert ops[failed].kind == "forward" and ops[failed].stage == 1
    marks = {op.event for op in ops[failed:] if op.op == "record" and op.slot == ops[failed].slot}
    assert any(op.op == "wait" and op.slot == caller and op.event in marks for op in ops[failed:])

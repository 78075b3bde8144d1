"""The recorded event plan orders every task after what it reads."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from mpstream.runtime.plan import Plan, PlanError, record_plan, verify_plan
from mpstream.runtime.scheduler import EventScheduler
from mpstream.schedules import placement_of
from mpstream.schedules.schedule import Schedule, Topology
from tests.helpers import virtual_for

LAYOUTS = {
    "distinct": lambda n: [f"cuda:{i}" for i in range(n)],
    "one-gpu": lambda n: ["cuda:0"] * n,
    "mixed": lambda n: [f"cuda:{i // 2}" for i in range(n)],
    "cpu": lambda n: ["cpu"] * n,
}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "chunks"), [(1, 1), (1, 3), (2, 1), (2, 4), (3, 5), (4, 8)])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("input_device", [None, "cpu"])
def test_plans_are_valid(
    schedule: str, stages: int, chunks: int, layout: str, input_device: str | None
) -> None:
    for backward in (False, True) if schedule == "gpipe" else (True,):
        plan = record_plan(
            schedule,
            stages,
            chunks,
            LAYOUTS[layout](stages),
            input_device=input_device,
            backward=backward,
        )
        verify_plan(plan)
        runs = [op for op in plan.ops if op.op == "run"]
        assert len({(op.kind, op.stage, op.micro) for op in runs}) == len(runs)


def test_source_waits_are_issued_once_and_only_when_not_implied() -> None:
    plan = record_plan("gpipe", 3, 6, ["cuda:0", "cuda:0", "cuda:1"])
    sources = {op.event for op in plan.ops if op.op == "record" and op.task == -1}

    def source_waits(slot: int) -> int:
        return sum(op.op == "wait" and op.slot == slot and op.event in sources for op in plan.ops)

    # Stage 0 and stage 2 (first on cuda:1) wait once; stage 1 inherits the
    # wait from stage 0 on the same device through its data dependency.
    assert [source_waits(slot) for slot in (0, 2, 4)] == [1, 0, 1]


def test_every_wait_is_needed() -> None:
    """Dropping any single wait from a valid plan makes it invalid."""
    plan = record_plan(
        "gpipe", 3, 4, ["cuda:0", "cuda:1", "cuda:1"], input_device="cpu", backward=True
    )
    verify_plan(plan)
    waits = [i for i, op in enumerate(plan.ops) if op.op == "wait"]
    assert waits
    for i in waits:
        broken = Plan(
            plan.ops[:i] + plan.ops[i + 1 :], plan.slot_names, plan.slot_devices, plan.stages
        )
        with pytest.raises(PlanError):
            verify_plan(broken)


def test_reusing_an_event_too_early_is_caught() -> None:
    plan = record_plan("gpipe", 2, 3, ["cuda:0", "cuda:1"])
    ops = list(plan.ops)
    copy_events = {op.event for op in ops if op.op == "record" and op.kind == "copy"}
    wait_at = next(
        i
        for i, op in enumerate(ops)
        if op.op == "wait" and op.kind == "forward" and op.stage == 1 and op.event in copy_events
    )
    # The pool hands the copy's event to stage 0's compute stream before the
    # consumer waited: the wait now sees that record, not the copy's.
    ops.insert(wait_at, ops[wait_at]._replace(op="record", slot=0, task=99))
    with pytest.raises(PlanError, match=r"forward\(stage=1, micro=0\) is not ordered after copy"):
        verify_plan(Plan(ops, plan.slot_names, plan.slot_devices, plan.stages))


def test_input_copies_wait_on_the_source() -> None:
    plan = record_plan("gpipe", 2, 2, ["cuda:0", "cuda:1"], input_device="cpu")
    verify_plan(plan)
    sources = {op.event for op in plan.ops if op.op == "record" and op.task == -1}
    first_copy = next(i for i, op in enumerate(plan.ops) if op.kind == "copy" and op.stage == -1)
    assert plan.ops[first_copy].op == "wait" and plan.ops[first_copy].event in sources


def test_plan_uses_few_events() -> None:
    def events(micros: int, backward: bool) -> int:
        plan = record_plan("gpipe", 4, micros, [f"cuda:{i}" for i in range(4)], backward=backward)
        return len({op.event for op in plan.ops if op.event >= 0})

    for backward in (False, True):
        # The pool recycles: the count depends on the stages, not the micro-batches.
        assert events(64, backward) == events(8, backward) <= 6 * 4


def test_plan_prints_readably() -> None:
    text = str(record_plan("gpipe", 2, 2, ["cuda:0", "cuda:1"]))
    assert "source" in text and "join" in text
    assert "stage0.copy@cuda:0" in text and "forward(stage=1, micro=1)" in text


def test_verify_plan_names_what_it_takes() -> None:
    with pytest.raises(TypeError, match=r"verify_plan takes a Plan, as mpstream.record_plan"):
        verify_plan("x")  # type: ignore[arg-type]


def test_record_plan_checks_devices() -> None:
    with pytest.raises(ValueError, match="2 entries for 3 stages"):
        record_plan("gpipe", 3, 2, ["cuda:0", "cuda:1"])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"devices": ["gpu", "gpu"]}, ValueError, r"devices\[0\] is 'gpu', not a device"),
        ({"devices": "cuda:0"}, TypeError, "devices must be a list with one device per stage"),
        ({"input_device": "host"}, ValueError, "input_device is 'host', not a device"),
        (
            {"backward": True, "target_device": "gpu:1"},
            ValueError,
            "target_device is 'gpu:1', not a device",
        ),
    ],
)
def test_record_plan_names_a_bad_device(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        record_plan("gpipe", 2, 2, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("layout", ["distinct", "one-gpu"])
def test_host_transfers_run_on_the_io_stream_and_order_their_readers(
    schedule: str, layout: str
) -> None:
    devices = LAYOUTS[layout](3)
    plan = record_plan(
        schedule, 3, 4, devices, input_device="cpu", target_device="cpu", backward=True
    )
    verify_plan(plan)
    runs = [op for op in plan.ops if op.op == "run"]
    inputs = [op for op in runs if op.kind == "copy" and op.stage == -1]
    targets = [op for op in runs if op.kind == "target"]
    assert [op.micro for op in inputs] == [op.micro for op in targets] == [0, 1, 2, 3]
    assert {plan.slot_names[op.slot] for op in inputs} == {f"io@{devices[0]}"}
    assert {plan.slot_names[op.slot] for op in targets} == {f"io@{devices[-1]}"}
    # Never behind inter-stage copies: nothing else runs on an io stream.
    io_slots = {i for i, name in enumerate(plan.slot_names) if name.startswith("io@")}
    assert all(op.kind in ("copy", "target") for op in runs if op.slot in io_slots)


def test_dropping_a_target_wait_is_caught() -> None:
    plan = record_plan("1f1b", 2, 3, ["cuda:0", "cuda:1"], target_device="cpu", backward=True)
    verify_plan(plan)
    recorded: dict[int, str] = {}  # event -> kind of its latest record (events are reused)
    waits = []
    for i, op in enumerate(plan.ops):
        if op.op == "record":
            recorded[op.event] = op.kind
        elif op.op == "wait" and recorded[op.event] == "target":
            waits.append(i)
    assert len(waits) == 3
    for i in waits:
        broken = Plan(plan.ops[:i] + plan.ops[i + 1 :], *_meta(plan))
        with pytest.raises(PlanError, match=r"forward\(stage=1, micro=\d\) is not ordered after"):
            verify_plan(broken)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_forced_copies_on_one_device_are_planned_and_valid(schedule: str, stages: int) -> None:
    plan = record_plan(
        schedule,
        stages,
        5,
        ["cuda:0"] * stages,
        input_device="cpu",
        backward=True,
        force_copies=True,
    )
    verify_plan(plan)
    runs = {(op.kind, op.stage, op.micro) for op in plan.ops if op.op == "run"}
    for s in range(stages - 1):
        assert {("copy", s, m) for m in range(5)} <= runs
        assert {("copy_grad", s, m) for m in range(5)} <= runs
    # The copy is issued on the sending stage's copy stream, whose events
    # the receiving copy stream then waits on.
    copy_runs = [op for op in plan.ops if op.op == "run" and op.kind == "copy" and op.stage >= 0]
    assert all(plan.slot_names[op.slot] == f"stage{op.stage}.copy@cuda:0" for op in copy_runs)


def test_target_device_needs_a_training_schedule() -> None:
    with pytest.raises(ValueError, match="training steps"):
        record_plan("gpipe", 2, 2, ["cuda:0", "cuda:1"], target_device="cpu")


def _meta(plan: Plan) -> tuple[list[str], list[object], int]:
    return plan.slot_names, plan.slot_devices, plan.stages  # type: ignore[return-value]


NEWER = {
    "round-robin": lambda n: [f"cuda:{i % 2}" for i in range(n)],
    "v": lambda n: [f"cuda:{min(i, n - 1 - i)}" for i in range(n)],
    "one-gpu": lambda n: ["cuda:0"] * n,
    "cpu": lambda n: ["cpu"] * n,
}
# The layouts each placement takes (on one device, virtual_stages gives it).
PLACED = {
    "round_robin": ("round-robin", "one-gpu", "cpu"),
    "v": ("v", "one-gpu", "cpu"),
    "stage": tuple(NEWER),
}
NAMES = ["interleaved_1f1b", "zb_h1", "looped_bfs", "interleaved_zb", "zbv", "dualpipev", "custom"]


@pytest.mark.parametrize(
    ("schedule", "layout"),
    [(n, layout) for n in NAMES for layout in PLACED[placement_of(n)]],
)
@pytest.mark.parametrize(("stages", "chunks"), [(2, 1), (2, 4), (4, 3), (4, 8)])
@pytest.mark.parametrize("input_device", [None, "cpu"])
def test_plans_of_the_schedules_of_several_stages_per_rank_and_user_orders_are_valid(
    schedule: str, stages: int, chunks: int, layout: str, input_device: str | None
) -> None:
    from mpstream.schedules.schedule import Schedule

    devices = NEWER[layout](stages)
    virtual = virtual_for(schedule, stages) if layout in ("one-gpu", "cpu", "v") else None
    name: object = schedule
    if schedule == "custom":  # zb_h1's order with every weight pass last
        order = str(Schedule("zb_h1", stages, chunks, [False] * stages)).split()
        name = [a for a in order if a[0] != "W"] + [a for a in order if a[0] == "W"]
    plan = record_plan(
        name,  # type: ignore[arg-type]
        stages,
        chunks,
        devices,
        input_device=input_device,
        target_device="cpu",
        backward=True,
        virtual_stages=virtual,
    )
    verify_plan(plan)
    runs = [(op.kind, op.stage, op.micro) for op in plan.ops if op.op == "run" and op.task >= 0]
    if schedule in ("zb_h1", "interleaved_zb", "zbv", "custom"):
        assert {("weight", s, m) for s in range(stages) for m in range(chunks)} <= set(runs)


def test_a_weight_pass_before_its_backward_is_caught() -> None:
    plan = record_plan("zb_h1", 2, 2, ["cuda:0", "cuda:1"], backward=True)
    verify_plan(plan)
    ops = list(plan.ops)
    w = next(i for i, op in enumerate(ops) if op.op == "run" and op.kind == "weight")
    b = next(
        i
        for i, op in enumerate(ops)
        if op.op == "run" and op.kind == "backward"
        and (op.stage, op.micro) == (ops[w].stage, ops[w].micro)
    )  # fmt: skip
    ops.insert(b, ops.pop(w))
    with pytest.raises(PlanError, match=r"weight\(stage=\d, micro=\d\) is not ordered after back"):
        verify_plan(Plan(ops, *_meta(plan)))


@pytest.mark.parametrize("kind", ["copy", "copy_grad"])
def test_a_value_on_another_device_read_with_no_copy_is_caught(kind: str) -> None:
    # The events still order the stages; what is missing is the copy itself.
    plan = record_plan("1f1b", 2, 2, ["cuda:0", "cuda:1"], backward=True)
    verify_plan(plan)
    ops = [op for op in plan.ops if not (op.op == "run" and op.kind == kind)]
    task = "forward(stage=1" if kind == "copy" else "backward(stage=0"
    with pytest.raises(PlanError, match=rf"{re.escape(task)}, micro=0\) reads \('{kind}'"):
        verify_plan(Plan(ops, *_meta(plan)))


def _runs(count: int) -> Plan:
    """A scheduler's plan of ``count`` training runs of two stages on two GPUs."""
    sched = EventScheduler([torch.device("cuda:0"), torch.device("cuda:1")], virtual=True)
    sched.recording = True
    schedule = Schedule("1f1b", 2, 3, Topology(((-1,), (0,)), (0, 1), 0, False), backward=True)
    for _ in range(count):
        sched.native.begin_run(schedule.native, sched.caller_streams())
        for task in schedule.tasks:
            sched.native.end(sched.native.begin(task.index))
        sched.native.join()
    return Plan(sched.plan(), sched.slot_names, sched.slot_devices, 2)


def test_a_plan_of_several_runs_is_checked_run_by_run() -> None:
    plan = _runs(2)
    verify_plan(plan)
    # A wait dropped from either run is caught: the second run's tasks read
    # what the second run produced, not what the first one did, and each
    # run's callers join it.
    waits = [i for i, op in enumerate(plan.ops) if op.op == "wait"]
    assert len([i for i in waits if plan.ops[i].slot in plan.callers]) == 4  # 2 joins a run
    for i in waits:
        with pytest.raises(PlanError):
            verify_plan(Plan(plan.ops[:i] + plan.ops[i + 1 :], *_meta(plan)))


@pytest.mark.parametrize("stages", [0, -1, 2.0, True])
def test_record_plan_names_a_stage_count_that_is_not_one(stages: object) -> None:
    with pytest.raises(ValueError, match=r"stages must be a positive int, got"):
        record_plan("gpipe", stages, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("chunks", [0, 2.5, "3", True])
def test_record_plan_names_a_chunk_count_that_is_not_one(chunks: object) -> None:
    # Was pybind's "incompatible function arguments" (or True as 1).
    with pytest.raises(ValueError, match=r"chunks must be a positive int, got"):
        record_plan("gpipe", 2, chunks, ["cpu", "cpu"])  # type: ignore[arg-type]


def test_record_plan_takes_numpy_integers() -> None:
    # As Schedule does: counts read from an array are ints to the user.
    plan = record_plan("gpipe", np.int64(2), np.int32(3), ["cpu", "cpu"])  # type: ignore[arg-type]
    assert plan == record_plan("gpipe", 2, 3, ["cpu", "cpu"])


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "F0m0 F1m0 B1m0 B0m0"])
def test_record_plan_refuses_virtual_stages_where_pipe_and_simulate_do(schedule: str) -> None:
    # It was dropped silently: the plan of another placement than asked.
    with pytest.raises(ValueError, match="applies to the schedules that place several stages"):
        record_plan(schedule, 2, 1, ["cuda:0", "cuda:0"], backward=True, virtual_stages=2)


def test_record_plan_places_stages_by_default_as_simulate_does() -> None:
    # Without devices, a V schedule's stages are placed in a V (cuda:0, cuda:1,
    # cuda:1, cuda:0), not refused for sitting on four devices.
    v = ["cuda:0", "cuda:1", "cuda:1", "cuda:0"]
    assert record_plan("zbv", 4, 8, backward=True) == record_plan("zbv", 4, 8, v, backward=True)
    # A round-robin one needs its ranks, as in simulate: a device per stage
    # would silently record one stage per rank.
    with pytest.raises(ValueError, match=r"give virtual_stages= .* or devices="):
        record_plan("interleaved_1f1b", 4, 8, backward=True)
    rr = ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert record_plan("looped_bfs", 4, 8, backward=True, virtual_stages=2) == record_plan(
        "looped_bfs", 4, 8, rr, backward=True
    )
    verify_plan(record_plan("interleaved_1f1b", 4, 8, backward=True, virtual_stages=2))
    # A V of two stages is one rank: its devices cannot say it.
    verify_plan(record_plan("dualpipev", 2, 4, backward=True))

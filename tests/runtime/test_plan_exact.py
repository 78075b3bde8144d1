"""The recorded plan, op for op: which stream waits on which stream's event.

:func:`~mpstream.runtime.plan.verify_plan` checks that a plan is enough:
each task is ordered after what it reads. It cannot tell a plan that waits
more than it should (a wait on the wrong stream that still orders the reader
through another path, an extra wait that serialises two streams) from the
plan the scheduler means to issue. Here the plans of small schedules (gpipe,
1F1B, zero-bubble, a skip connection across stages, stages sharing a device
and stages on two, transfers from the host) are compared, op for op, with

- listings written out by hand for the smallest cases, and
- :func:`expected_plan`, derived in Python from the schedule's dependencies
  by the rules below (a model of what the scheduler promises, not its code).

The rules. A forward, backward or weight task runs on its stage's compute
stream. A copy between stages runs on the sending stage's copy stream and is
received on the receiving stage's (a gradient copy the other way round); when
the two differ the sender records an event that the receiver waits on before
recording the copy's own. A transfer from the host runs on the io stream of
the receiving device. Before it runs, a task makes the stream it runs on wait
for each task it depends on that ended on another stream, unless that
stream is ordered after it already (by an earlier wait, directly or through
another stream's wait) or waiting for another of its dependencies implies it;
then forward, backward and weight tasks and host transfers wait for their
device's caller stream (the run's source event), unless ordered after it
already. A task ends with a record on the stream that received it. At the
end each caller stream waits for the last record of every stream on its
device, except those another of them was recorded after.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from mpstream.runtime.plan import Plan, record_plan, verify_plan
from mpstream.runtime.scheduler import PlanOp
from mpstream.schedules.schedule import Kind, Schedule, Task, Topology, virtual_stages_of

LETTERS = {"forward": "F", "backward": "B", "weight": "W", "target": "T"}


def task_label(kind: str, stage: int, peer: int, micro: int) -> str:
    """``F1m0``; a copy ``C0>1m0`` (``in>0m0`` from the host); a gradient
    copy ``G1>0m0`` (from stage 1 back to stage 0); a target ``T1m0``."""
    if kind == "copy":
        return f"{'in' if stage < 0 else f'C{stage}'}>{peer}m{micro}"
    if kind == "copy_grad":
        return f"G{peer}>{stage}m{micro}"
    return f"{LETTERS[kind]}{stage}m{micro}"


def short(slot: str) -> str:
    """``stage1.compute@cuda:1`` as ``compute1``; callers and io streams keep their names."""
    if slot.startswith("stage"):
        stage, role = slot.split("@")[0].removeprefix("stage").split(".")
        return f"{role}{stage}"
    return slot


def listing(plan: Plan) -> list[str]:
    """The plan's ops as ``F1m0: compute1 waits copy1 (C0>1m0)``: the
    waiting task, the waiting stream, and the stream and task of the record
    it waits on (events are pooled: the last record of the event before)."""
    lines = []
    recorded: dict[int, str] = {}
    for op in plan.ops:
        if op.task == -1 and op.stage == -1:
            what = "source" if op.op == "record" else "join"
        else:
            what = task_label(op.kind, op.stage, op.peer, op.micro)
        slot = short(plan.slot_names[op.slot])
        if op.op == "record":
            recorded[op.event] = f"{slot} ({what})"
            lines.append(f"{what}: {slot} records")
        elif op.op == "run":
            lines.append(f"{what}: {slot} runs")
        elif op.op == "wait":
            lines.append(f"{what}: {slot} waits {recorded[op.event]}")
        else:
            lines.append(f"{what}: {slot} {op.op} {op.event}")
    return lines


@dataclass
class Record:
    slot: int
    seq: int
    clock: dict[int, int]  # per stream, the last of its records this one is ordered after
    text: str


class Expected:
    """The rules of the module docstring, run over a schedule's tasks."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        self.callers = list(dict.fromkeys(self.devices))
        stages = len(self.devices)
        self.names = [f"{role}{s}" for s in range(stages) for role in ("compute", "copy")]
        self.names += [f"caller@{d}" for d in self.callers] + [f"io@{d}" for d in self.callers]
        self.device_of = [d for d in self.devices for _ in range(2)] + self.callers * 2
        self.clock: list[dict[int, int]] = [{} for _ in self.names]
        self.latest: dict[int, Record] = {}
        self.lines: list[str] = []

    def caller(self, slot: int) -> int:
        return 2 * len(self.devices) + self.callers.index(self.device_of[slot])

    def io(self, stage: int) -> int:
        return 2 * len(self.devices) + len(self.callers) + self.callers.index(self.devices[stage])

    def record(self, slot: int, what: str) -> Record:
        clock = self.clock[slot]
        clock[slot] = clock.get(slot, 0) + 1
        self.lines.append(f"{what}: {self.names[slot]} records")
        rec = Record(slot, clock[slot], dict(clock), f"{self.names[slot]} ({what})")
        self.latest[slot] = rec
        return rec

    def ordered_after(self, clock: dict[int, int], rec: Record) -> bool:
        return clock.get(rec.slot, 0) >= rec.seq

    def wait(self, slot: int, rec: Record, what: str) -> None:
        if rec.slot == slot or self.ordered_after(self.clock[slot], rec):
            return
        for s, seq in rec.clock.items():
            self.clock[slot][s] = max(self.clock[slot].get(s, 0), seq)
        self.lines.append(f"{what}: {self.names[slot]} waits {rec.text}")

    def slots(self, task: Task) -> tuple[int | None, int]:
        """(the stream a task is issued on, if not the receiving one; the receiving one)."""
        s, peer = task.stage, task.peer
        if task.kind is Kind.COPY:
            return (None, self.io(peer)) if s < 0 else (2 * s + 1, 2 * peer + 1)
        if task.kind is Kind.COPY_GRAD:
            return 2 * peer + 1, 2 * s + 1
        if task.kind is Kind.TARGET:
            return None, self.io(s)
        return 2 * s, 2 * s

    def run(self, schedule: Schedule) -> list[str]:
        for c in range(len(self.callers)):
            self.record(2 * len(self.devices) + c, "source")
        done: dict[int, Record] = {}
        for task in schedule.tasks:
            what = task_label(task.kind.label, task.stage, task.peer, task.micro)
            issue, receive = self.slots(task)
            at = receive if issue is None else issue
            deps = [done[d] for d in task.deps]
            for rec in deps:
                implied = any(o is not rec and self.ordered_after(o.clock, rec) for o in deps)
                if not implied:
                    self.wait(at, rec, what)
            if task.kind is not Kind.COPY_GRAD and (task.kind is not Kind.COPY or task.stage < 0):
                self.wait(at, self.latest[self.caller(at)], what)
            self.lines.append(f"{what}: {self.names[at]} runs")
            if issue is not None and issue != receive:
                self.wait(receive, self.record(issue, what), what)
            done[task.index] = self.record(receive, what)
        for c in range(len(self.callers)):
            caller = 2 * len(self.devices) + c
            last = [
                self.latest[x]
                for x in range(2 * len(self.devices))
                if x in self.latest and self.device_of[x] == self.callers[c]
            ]
            io = caller + len(self.callers)
            last += [self.latest[io]] if io in self.latest else []
            for rec in last:
                if not any(o is not rec and self.ordered_after(o.clock, rec) for o in last):
                    self.wait(caller, rec, "join")
        return self.lines


@dataclass(frozen=True)
class Case:
    """A small run: schedule, stages' devices, micro-batches, and where the data sits."""

    schedule: str
    devices: tuple[str, ...]
    chunks: int = 2
    backward: bool = True
    input_device: str | None = None
    target_device: str | None = None
    reads: tuple[tuple[int, ...], ...] | None = None
    force_copies: bool = False

    def plan(self) -> Plan:
        return record_plan(
            self.schedule,
            len(self.devices),
            self.chunks,
            list(self.devices),
            input_device=self.input_device,
            target_device=self.target_device,
            backward=self.backward,
            reads=self.reads,
            force_copies=self.force_copies,
        )

    def schedule_of(self) -> Schedule:
        """The schedule :meth:`plan` records, built the same way from the case."""
        devs = [torch.device(d) for d in self.devices]
        labels = list(dict.fromkeys(devs))
        src = torch.device(self.input_device) if self.input_device else devs[0]
        stages = len(devs)
        topology = Topology(
            self.reads or tuple((s - 1,) for s in range(stages)),
            tuple(labels.index(d) for d in devs),
            labels.index(src) if src in labels else -1,
            self.force_copies,
        )
        virtual = virtual_stages_of(devs) if self.schedule == "interleaved_1f1b" else 1
        return Schedule(
            self.schedule,
            stages,
            self.chunks,
            topology,
            backward=self.backward,
            copy_target=self.target_device is not None
            and torch.device(self.target_device) != devs[-1],
            virtual_stages=virtual,
        )

    def expected(self) -> list[str]:
        return Expected([torch.device(d) for d in self.devices]).run(self.schedule_of())


TWO = ("cuda:0", "cuda:1")
ONE = ("cuda:0", "cuda:0")
SKIP = ((-1,), (0,), (0, 1))  # stage 2 reads stage 0 past stage 1, and stage 1

CASES = {
    "gpipe-forward-two-gpus": Case("gpipe", TWO, backward=False),
    "gpipe-two-gpus": Case("gpipe", TWO),
    "gpipe-one-gpu": Case("gpipe", ONE, 3),
    "1f1b-two-gpus": Case("1f1b", TWO, 3),
    "1f1b-one-gpu": Case("1f1b", ONE),
    "1f1b-three-stages-two-on-one-gpu": Case("1f1b", ("cuda:0", "cuda:0", "cuda:1"), 3),
    "1f1b-host-input-and-target": Case("1f1b", TWO, 3, input_device="cpu", target_device="cpu"),
    "gpipe-host-input-one-gpu": Case("gpipe", ONE, input_device="cpu"),
    "1f1b-forced-copies-one-gpu": Case("1f1b", ONE, force_copies=True),
    "zb_h1-two-gpus": Case("zb_h1", TWO),
    "interleaved-two-gpus": Case("interleaved_1f1b", ("cuda:0", "cuda:1") * 2, 4),
    "skip-one-copy-to-cuda1": Case("1f1b", ("cuda:0", "cuda:1", "cuda:1"), reads=SKIP),
    "skip-a-copy-to-each-gpu": Case("gpipe", ("cuda:0", "cuda:1", "cuda:2"), reads=SKIP),
    "skip-on-one-gpu": Case("1f1b", ("cuda:0",) * 3, reads=SKIP),
    "cpu-stages": Case("1f1b", ("cpu", "cpu")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_equals_the_plan_derived_from_the_dependencies(name: str) -> None:
    case = CASES[name]
    plan = case.plan()
    model = Expected([torch.device(d) for d in case.devices])
    assert [short(n) for n in plan.slot_names] == model.names
    assert plan.slot_devices == model.device_of
    assert listing(plan) == case.expected()
    verify_plan(plan)  # and what the rules give is enough


# Written out by hand from what each task reads.
GPIPE_FORWARD_TWO_GPUS = [
    "source: caller@cuda:0 records",
    "source: caller@cuda:1 records",
    "F0m0: compute0 waits caller@cuda:0 (source)",
    "F0m0: compute0 runs",
    "F0m0: compute0 records",
    "C0>1m0: copy0 waits compute0 (F0m0)",  # the copy reads the forward's output
    "C0>1m0: copy0 runs",
    "C0>1m0: copy0 records",
    "C0>1m0: copy1 waits copy0 (C0>1m0)",  # received on stage 1's copy stream
    "C0>1m0: copy1 records",
    "F0m1: compute0 runs",  # after the source already: nothing to wait for
    "F0m1: compute0 records",
    "C0>1m1: copy0 waits compute0 (F0m1)",
    "C0>1m1: copy0 runs",
    "C0>1m1: copy0 records",
    "C0>1m1: copy1 waits copy0 (C0>1m1)",
    "C0>1m1: copy1 records",
    "F1m0: compute1 waits copy1 (C0>1m0)",
    "F1m0: compute1 waits caller@cuda:1 (source)",  # the copy came from cuda:0's source
    "F1m0: compute1 runs",
    "F1m0: compute1 records",
    "F1m1: compute1 waits copy1 (C0>1m1)",
    "F1m1: compute1 runs",
    "F1m1: compute1 records",
    "join: caller@cuda:0 waits copy0 (C0>1m1)",  # after F0m1 too
    "join: caller@cuda:1 waits compute1 (F1m1)",  # after copy1's last record too
]

ONE_F_ONE_B_ONE_GPU = [
    "source: caller@cuda:0 records",
    "F0m0: compute0 waits caller@cuda:0 (source)",
    "F0m0: compute0 runs",
    "F0m0: compute0 records",
    "F1m0: compute1 waits compute0 (F0m0)",  # one device: no copy; the source is implied
    "F1m0: compute1 runs",
    "F1m0: compute1 records",
    "F0m1: compute0 runs",
    "F0m1: compute0 records",
    "B1m0: compute1 runs",  # reads F1m0, on its own stream
    "B1m0: compute1 records",
    "B0m0: compute0 waits compute1 (B1m0)",
    "B0m0: compute0 runs",
    "B0m0: compute0 records",
    "F1m1: compute1 waits compute0 (F0m1)",
    "F1m1: compute1 runs",
    "F1m1: compute1 records",
    "B1m1: compute1 runs",
    "B1m1: compute1 records",
    "B0m1: compute0 waits compute1 (B1m1)",
    "B0m1: compute0 runs",
    "B0m1: compute0 records",
    "join: caller@cuda:0 waits compute0 (B0m1)",  # which waited for compute1's last
]

SKIP_ACROSS_STAGES = [
    "source: caller@cuda:0 records",
    "source: caller@cuda:1 records",
    "F0m0: compute0 waits caller@cuda:0 (source)",
    "F0m0: compute0 runs",
    "F0m0: compute0 records",
    "C0>1m0: copy0 waits compute0 (F0m0)",  # one copy to cuda:1, for stages 1 and 2
    "C0>1m0: copy0 runs",
    "C0>1m0: copy0 records",
    "C0>1m0: copy1 waits copy0 (C0>1m0)",
    "C0>1m0: copy1 records",
    "F1m0: compute1 waits copy1 (C0>1m0)",
    "F1m0: compute1 waits caller@cuda:1 (source)",
    "F1m0: compute1 runs",
    "F1m0: compute1 records",
    "F2m0: compute2 waits compute1 (F1m0)",  # which implies the copy (and the source)
    "F2m0: compute2 runs",
    "F2m0: compute2 records",
    "B2m0: compute2 runs",
    "B2m0: compute2 records",
    "B1m0: compute1 waits compute2 (B2m0)",
    "B1m0: compute1 runs",
    "B1m0: compute1 records",
    "G1>0m0: copy1 waits compute1 (B1m0)",  # after stage 2's backward too, through B1m0
    "G1>0m0: copy1 runs",
    "G1>0m0: copy1 records",
    "G1>0m0: copy0 waits copy1 (G1>0m0)",
    "G1>0m0: copy0 records",
    "B0m0: compute0 waits copy0 (G1>0m0)",
    "B0m0: compute0 runs",
    "B0m0: compute0 records",
    "join: caller@cuda:0 waits compute0 (B0m0)",
    "join: caller@cuda:1 waits copy1 (G1>0m0)",
]

BY_HAND = {
    "gpipe-forward-two-gpus": (CASES["gpipe-forward-two-gpus"], GPIPE_FORWARD_TWO_GPUS),
    "1f1b-one-gpu": (CASES["1f1b-one-gpu"], ONE_F_ONE_B_ONE_GPU),
    "skip-across-stages": (
        Case("gpipe", ("cuda:0", "cuda:1", "cuda:1"), 1, reads=SKIP),
        SKIP_ACROSS_STAGES,
    ),
}


@pytest.mark.parametrize("name", sorted(BY_HAND))
def test_plan_equals_the_listing_written_by_hand(name: str) -> None:
    case, lines = BY_HAND[name]
    assert listing(case.plan()) == lines
    assert case.expected() == lines  # the model agrees with the hand


def test_the_listing_names_each_wait_by_the_record_it_waits_on() -> None:
    # Events are pooled: a wait names the last record of its event before it.
    ops = [
        PlanOp("record", 0, 7, 0, "forward", 0, 0, 0),
        PlanOp("wait", 1, 7, 1, "copy", 0, 0, 1),
        PlanOp("record", 2, 7, 2, "forward", 1, 0, 1),
        PlanOp("wait", 0, 7, 3, "backward", 0, 0, 0),
    ]
    names = ["stage0.compute@cuda:0", "stage0.copy@cuda:0", "stage1.compute@cuda:1"]
    plan = Plan(ops, names, [torch.device("cuda:0")] * 2 + [torch.device("cuda:1")], 2)
    assert listing(plan) == [
        "F0m0: compute0 records",
        "C0>1m0: copy0 waits compute0 (F0m0)",
        "F1m0: compute1 records",
        "B0m0: compute0 waits compute1 (F1m0)",
    ]

"""A step on several GPUs captured per device: each segment on its own
device's launch stream, a prologue and an epilogue per device, copies
between devices pulled by the receiver; checked on the CPU with the fake
CUDA objects of fakes.py and a scheduler without devices. On two GPUs
(skipped elsewhere): CapturedStep across devices trains like the model."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

from mpstream import CapturedStep, Pipe
from mpstream.capture.edges import GraphEdges
from mpstream.runtime.plan import PlanError, record_plan, verify_plan
from mpstream.runtime.scheduler import EventScheduler
from tests.capture.fakes import FakeStream, World
from tests.helpers import mlp

D0, D1 = torch.device("cuda:0"), torch.device("cuda:1")


def _captured(name: str, micros: int = 4):  # type: ignore[no-untyped-def]
    world = World()
    mains = {D0: world.main, D1: FakeStream(world, "main1")}
    edges = GraphEdges(mains, world.cuda())
    with world.use(world.main):
        edges.begin_step()
        plan = record_plan(name, 2, micros, [D0, D1], backward=True, groups=[0, 1], edges=edges)
        edges.end_step()
    return world, edges, plan


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1"])
def test_a_step_on_two_gpus_is_captured_per_device(name: str) -> None:
    world, edges, plan = _captured(name)
    verify_plan(plan)  # a segment holds one device's work, among the capture rules
    begins = [(g, s[0]) for what, g, *s in world.log if what == "begin"]
    assert [s for _, s in begins[:2]] == ["main", "main1"], "a prologue per device"
    assert [s for _, s in begins[-2:]] == ["main", "main1"], "an epilogue per device"
    assert set(edges.prologue) == set(edges.epilogue) == {D0, D1}
    segments = [s for _, s in begins[2:-2]]
    launch = {group: stream.name for group, stream in edges.launch.items()}
    assert segments == [launch[g] for g, _ in edges.segments]
    assert edges.complete and edges.launches == len(edges.segments) + 4
    # Each segment runs on the device of its group (stage g on cuda:g).
    seg_device = {
        op.event: plan.slot_devices[op.slot] for op in plan.ops if op.op == "begin_segment"
    }
    assert [seg_device[i] for i in range(len(edges.segments))] == [
        torch.device(f"cuda:{g}") for g, _ in edges.segments
    ]
    # Copies between devices run wholly on the receiving device.
    pulls = [op for op in plan.ops if op.op == "run" and op.kind in ("copy", "copy_grad")]
    assert pulls
    for op in pulls:
        receiver = op.peer if op.kind == "copy" else op.stage
        assert plan.slot_devices[op.slot] == torch.device(f"cuda:{receiver}")
    assert any(e[0] == "wait" for e in world.log), "devices meet through external events"

    world.log.clear()
    edges.replay()
    replays = [e for e in world.log if e[0] == "replay"]
    assert [r[2] for r in replays[:2]] == ["main", "main1"]
    assert [r[2] for r in replays[-2:]] == ["main", "main1"]
    assert [r[2] for r in replays[2:-2]] == [launch[g] for g, _ in edges.segments]
    first, last = world.log.index(replays[2]), world.log.index(replays[-3])
    before, after = world.log[:first], world.log[last:]
    for name_ in launch.values():
        for main in ("main", "main1"):
            assert ("wait_stream", name_, main) in before
            assert ("wait_stream", main, name_) in after


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1"])
def test_external_events_land_on_the_streams_of_the_tasks_that_use_them(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each external event is recorded on the producing task's stream and
    waited on by the reading task's, exactly the slots the plan logs (not
    the segment's launch stream, which would order too little or too much)."""
    world = World()
    streams: dict[int, FakeStream] = {}

    def slot_stream(self: EventScheduler, slot: int) -> FakeStream:
        return streams.setdefault(slot, FakeStream(world, f"slot{slot}"))

    monkeypatch.setattr(EventScheduler, "slot_stream", slot_stream)
    mains = {D0: world.main, D1: FakeStream(world, "main1")}
    edges = GraphEdges(mains, world.cuda())
    with world.use(world.main):
        edges.begin_step()
        plan = record_plan(name, 2, 4, [D0, D1], backward=True, groups=[0, 1], edges=edges)
        edges.end_step()
    planned = {
        kind: [f"slot{op.slot}" for op in plan.ops if op.op == "x" + kind]
        for kind in ("wait", "record")
    }
    assert planned["wait"] and planned["record"]
    for kind, names in planned.items():
        assert [e[-1] for e in world.log if e[0] == kind] == names, kind


def test_a_copy_between_devices_is_issued_in_its_readers_segment() -> None:
    _, _, plan = _captured("1f1b", micros=3)
    segment, runs = -1, []
    for op in plan.ops:
        if op.op == "begin_segment":
            segment = op.event
        elif op.op == "run":
            runs.append((segment, op.kind, op.stage, op.peer, op.micro))
    for i, (seg, kind, stage, peer, micro) in enumerate(runs):
        if kind == "copy":  # read next by the receiving stage's forward
            nxt = runs[i + 1]
            assert (nxt[0], nxt[1], nxt[2], nxt[4]) == (seg, "forward", peer, micro)
        elif kind == "copy_grad":  # read next by the stage's backward
            assert runs[i + 1][1:3] == ("backward", stage) and runs[i + 1][0] == seg


def test_verify_plan_catches_a_segment_using_another_devices_stream() -> None:
    _, _, plan = _captured("gpipe")
    ops = list(plan.ops)
    i = next(i for i, op in enumerate(ops) if op.op == "run" and op.kind == "copy")
    sender = plan.slot_names.index("stage0.copy@cuda:0")
    ops[i] = ops[i]._replace(slot=sender)
    with pytest.raises(PlanError, match="a segment holds one device's work"):
        verify_plan(replace(plan, ops=ops))


def test_edges_need_a_main_stream_on_every_segments_device() -> None:
    world = World()
    edges = GraphEdges({D0: world.main}, world.cuda())
    with world.use(world.main):
        edges.begin_step()
        with pytest.raises(RuntimeError, match="segment 0 is on cuda:1, but the step is captur"):
            edges.open(0, 1, D1)
        edges.abandon()
    assert not world.capturing
    with pytest.raises(ValueError, match="at least one device"):
        GraphEdges({}, world.cuda())


# -- two GPUs ---------------------------------------------------------------

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)


def _two_gpu_pipe(schedule: str) -> tuple[Pipe, nn.Module]:
    torch.manual_seed(0)
    model = mlp([6, 16, 16, 4]).double()
    ref = copy.deepcopy(model)  # trained on the CPU
    pipe = Pipe(model, chunks=3, balance=[2, 3], devices=["cuda:0", "cuda:1"], schedule=schedule)
    return pipe, ref


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_captured_steps_on_two_gpus_equal_plain_training(schedule: str) -> None:
    pipe, ref = _two_gpu_pipe(schedule)
    batches = [
        (torch.randn(7, 6, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64))
        for _ in range(3)
    ]
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    step = CapturedStep(pipe, *batches[0], nn.MSELoss(), optimizer=opt, groups=[0, 1])
    assert step.captured and step.launches == len(step._edges.segments) + 4  # type: ignore[union-attr]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for i, (x, y) in enumerate(batches):
        loss = step(x, y)  # host batches are copied in
        ref_opt.zero_grad()
        expected = nn.MSELoss()(ref(x), y)
        expected.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.cpu(), expected.detach(), msg=f"loss of step {i}")
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), msg=f"parameter {name}")


class _Slow(nn.Module):
    """Keeps its GPU busy before its output exists: a reader on another GPU
    that is not ordered after it reads stale memory."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(20_000_000)
        return x * 1.0


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_segmented_step_on_two_gpus_without_captures_trains_like_the_model(
    schedule: str,
) -> None:
    # The warm-up of a capture across GPUs: segments start from each
    # device's current stream, ordered across devices by one wait.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), _Slow(), nn.Linear(16, 4)).double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=3, balance=[2, 1], devices=["cuda:0", "cuda:1"], schedule=schedule)
    x, y = torch.randn(7, 6, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    with pipe.segmented():
        loss = pipe.train_step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach())
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad.cpu(), q.grad, msg=f"gradient of {name}")


@pytest.mark.cuda
@two_gpus
def test_two_gpus_without_groups_are_refused() -> None:
    pipe, _ = _two_gpu_pipe("1f1b")
    x, y = torch.randn(6, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="pass groups="):
        CapturedStep(pipe, x, y, nn.MSELoss())


def test_random_numbers_may_be_drawn_in_groups_on_two_devices() -> None:
    from mpstream.capture.groups import check_drawing

    check_drawing({0, 1}, [0, 1], [D0, D1])  # a generator each
    with pytest.raises(ValueError, match=r"stage 0 \(group 0\) and stage 1 \(group 1\)"):
        check_drawing({0, 1}, [0, 1], [D0, D0])
    check_drawing({0, 1}, [0, 0], [D0, D0])  # one group: its graphs run in order


def test_the_devices_a_step_is_captured_on() -> None:
    from mpstream.capture.groups import capture_devices

    cpu = torch.device("cpu")
    assert capture_devices([cpu, cpu], None) == []
    assert capture_devices([D0, D0], None) == [D0]
    assert capture_devices([D0, D1, D0], [0, 1, 2]) == [D0, D1]
    with pytest.raises(ValueError, match="pass groups="):
        capture_devices([D0, D1], None)
    with pytest.raises(ValueError, match="every stage on CPUs: stages are on cpu, cuda:0"):
        capture_devices([cpu, D0], [0, 1])


def test_the_async_allocator_is_refused_across_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpstream.capture.groups import capture_devices

    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    assert capture_devices([D0, D0], [0, 1]) == [D0]  # one GPU reads its own memory
    with pytest.raises(ValueError, match="cudaMallocAsync"):
        capture_devices([D0, D1], [0, 1])


def test_a_multi_gpu_capture_opens_its_side_by_side_captures_relaxed() -> None:
    world, edges, _ = _captured("gpipe")
    modes = [e[-1] for e in world.log if e[0] == "begin"]
    assert modes[:2] == modes[-2:] == ["relaxed", "relaxed"]  # prologues, epilogues
    assert set(modes[2:-2]) == {"thread_local"}  # one segment at a time

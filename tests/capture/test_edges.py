"""GraphEdges, checked on the CPU with fake CUDA objects that log: a step is
captured as prologue, one graph per segment on its group's launch stream,
and epilogue; external events are recorded and waited on inside segment
captures only; a replay launches in order with the streams ordered around
it; a failure ends the open capture and leaves the pipe as it was."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from mpstream import CapturedStep, Pipe
from mpstream.capture.edges import Cuda, GraphEdges, check_external_events
from mpstream.schedules.segments import segment
from tests.capture.test_step import assert_trains_like
from tests.helpers import assert_same_grads, mlp

CPU = torch.device("cpu")


class World:
    """Fake streams, graphs and events sharing one log and one current stream."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.main = FakeStream(self, "main")
        self.current = self.main
        self.capturing: dict[str, FakeGraph] = {}  # stream name -> graph capturing on it
        self.graphs: list[FakeGraph] = []
        self.streams = 0

    def cuda(self) -> Cuda:
        return Cuda(
            stream=self.stream,
            graph=lambda: FakeGraph(self),
            event=lambda: FakeEvent(self),
            marker=lambda: FakeMarker(self),
            use=self.use,
            pool=lambda: ("pool", len(self.graphs)),
            undo=FakeUndo(self),
        )

    def stream(self, device: torch.device) -> FakeStream:
        self.streams += 1
        return FakeStream(self, f"launch{self.streams}")

    @contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before


class FakeStream:
    def __init__(self, world: World, name: str) -> None:
        self.world, self.name = world, name

    def wait_stream(self, other: FakeStream) -> None:
        self.world.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, marker: FakeMarker) -> None:
        assert marker.on is not None, "waits on a recorded marker"
        self.world.log.append(("wait_stream", self.name, marker.on))


class FakeMarker:
    """An ordinary event: recorded and waited on outside captures only."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.on: str | None = None

    def record(self, stream: FakeStream) -> None:
        assert not self.world.capturing, "replay markers are not captured"
        self.on = stream.name


class FakeGraph:
    def __init__(self, world: World) -> None:
        self.world = world
        self.index = len(world.graphs)
        world.graphs.append(self)
        self.stream = ""
        self.fail_end = False

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        assert capture_error_mode in ("thread_local", "relaxed") and pool is not None
        assert self.world.current.name not in self.world.capturing, "one capture per stream"
        if capture_error_mode == "thread_local":
            assert not self.world.capturing, "side by side captures need relaxed mode"
        self.stream = self.world.current.name
        self.world.capturing[self.stream] = self
        self.world.log.append(("begin", self.index, self.stream, capture_error_mode))

    def capture_end(self) -> None:
        assert self.world.current.name == self.stream, "ended on its own stream"
        del self.world.capturing[self.stream]
        self.world.log.append(("end", self.index))
        if self.fail_end:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.ended = True

    def pool(self) -> Any:
        if not getattr(self, "ended", False):
            raise RuntimeError("the capture did not end")
        return ("pool", self.index)

    def replay(self) -> None:
        self.world.log.append(("replay", self.index, self.world.current.name))


class FakeUndo:
    """The calls that undo a failed capture, logged."""

    def __init__(self, world: World) -> None:
        self.world = world

    def device(self) -> int:
        return 0

    def capturing(self) -> bool:
        return self.world.current.name in self.world.capturing

    def end_routing(self, device: int, pool: Any) -> None:
        self.world.log.append(("end_routing", pool))

    def release(self, device: int, pool: Any) -> None:
        self.world.log.append(("release", pool))

    def keep(self, graph: Any) -> None:
        self.world.log.append(("keep", graph.index))

    def reset_generator(self) -> None:
        self.world.log.append(("reset_generator",))


class FakeEvent:
    def __init__(self, world: World) -> None:
        self.world = world
        self.recorded_in: int | None = None

    def _graph(self) -> int:
        # PyTorch makes a record or wait external only if the current stream captures.
        graph = self.world.capturing.get(self.world.current.name)
        assert graph is not None, "external event use outside a capturing current stream"
        return graph.index

    def record(self, stream: object) -> None:
        self.recorded_in = self._graph()
        self.world.log.append(("record", self.recorded_in))

    def wait(self, stream: object) -> None:
        graph = self._graph()
        assert self.recorded_in is not None and self.recorded_in < graph, "recorded earlier"
        self.world.log.append(("wait", graph, self.recorded_in))


def _pipe(schedule: str) -> tuple[Pipe, nn.Module]:
    model = mlp([5, 8, 7, 4])
    ref = mlp([5, 8, 7, 4])
    ref.load_state_dict(model.state_dict())
    return Pipe(model, chunks=3, balance=[2, 4], devices=["cpu"] * 2, schedule=schedule), ref


def _capture(world: World, pipe: Pipe, edges: GraphEdges, x: Any, y: Any) -> torch.Tensor:
    with world.use(world.main):
        edges.begin_step()
        pipe.zero_grad(set_to_none=False)
        with pipe.segmented([0, 1], edges):
            loss = pipe.train_step(x, y, nn.MSELoss())
        edges.end_step()
    return loss


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_a_step_is_captured_as_prologue_segments_and_epilogue(schedule: str) -> None:
    pipe, ref = _pipe(schedule)
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    world = World()
    edges = GraphEdges({CPU: world.main}, world.cuda())
    loss = _capture(world, pipe, edges, x, y)
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)

    parts = segment(pipe.schedule_for(3, torch.device("cpu"), training_step=True), [0, 1]).parts
    assert edges.complete and edges.launches == len(parts) + 2
    begins = [(g, s[:1]) for what, g, *s in world.log if what == "begin"]
    assert begins[0] == (0, ["main"]) and begins[-1] == (len(parts) + 1, ["main"])
    launch = {group: stream.name for group, stream in edges.launch.items()}
    assert [s[0] for _, s in begins[1:-1]] == [launch[p.group] for p in parts]
    assert [g for g, _ in edges.segments] == [p.group for p in parts]
    waits = [e for e in world.log if e[0] == "wait"]
    assert waits, "the groups' segments meet through external events"

    world.log.clear()
    edges.replay()
    replays = [e for e in world.log if e[0] == "replay"]
    assert replays[0] == ("replay", 0, "main") and replays[-1] == ("replay", len(parts) + 1, "main")
    assert [r[2] for r in replays[1:-1]] == [launch[p.group] for p in parts]
    first, last = world.log.index(replays[1]), world.log.index(replays[-2])
    before, after = world.log[:first], world.log[last:]
    for name in launch.values():
        assert ("wait_stream", name, "main") in before
        assert ("wait_stream", "main", name) in after


def test_a_failure_ends_the_open_capture_and_leaves_the_pipe_as_it_was() -> None:
    pipe, _ = _pipe("1f1b")
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    world = World()
    edges = GraphEdges({CPU: world.main}, world.cuda())

    def failing(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if len(world.graphs) > 2:  # inside a later segment
            world.graphs[-1].fail_end = True  # an invalidated capture raises at its end
            raise ValueError("loss failed")
        return nn.MSELoss()(out, target)

    with world.use(world.main):
        edges.begin_step()
        with pytest.raises(ValueError, match="loss failed"), pipe.segmented([0, 1], edges):
            pipe.train_step(x, y, failing)
    assert not world.capturing, "the open capture was ended"
    # Its end failed (an invalidated capture): the allocator's routing to its
    # pool is ended, the pool released, the generator reset.
    failed = world.graphs[-1].index
    undone = [e[0] for e in world.log[world.log.index(("end", failed)) :]]
    assert undone == ["end", "keep", "end_routing", "release", "reset_generator"]
    assert not edges.complete and not edges.segments and not edges.prologue
    assert all(p.grad is None for p in pipe.parameters())
    assert not pipe.scheduler.native.running
    with pytest.raises(RuntimeError, match="no complete step"):
        edges.replay()
    world2 = World()
    edges2 = GraphEdges({CPU: world2.main}, world2.cuda())
    _capture(world2, pipe, edges2, x, y)  # the pipe captures again
    assert edges2.complete


def test_misuse_is_named() -> None:
    world = World()
    edges = GraphEdges({CPU: world.main}, world.cuda())
    with pytest.raises(RuntimeError, match="outside a step's capture"):
        edges.open(0, 0, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="while capturing nothing"):
        edges.end_step()
    with world.use(world.main):
        edges.begin_step()
        with pytest.raises(RuntimeError, match="capture one step"):
            edges.begin_step()
        with pytest.raises(RuntimeError, match="while capturing the prologue"):
            edges.end_step()
        with pytest.raises(RuntimeError, match="outside a segment's capture"):
            edges.record(0, None)
        with pytest.raises(RuntimeError, match="recorded no event"):
            edges.wait(3, None)
        assert edges.open(0, 1, torch.device("cpu")) is None  # a CPU group: no scheduler stream
        edges.close(0)
        with pytest.raises(RuntimeError, match="segment 1 is on cuda:1, but the step is captur"):
            edges.open(1, 0, torch.device("cuda:1"))
        edges.open(1, 0, torch.device("cpu"))
        with pytest.raises(RuntimeError, match="the segment still open"):
            edges.done()
        edges.abandon()
    assert not world.capturing


# -- CapturedStep(groups=...) ------------------------------------------------


def _steps(device: str, schedule: str, groups: list[int], steps: int = 3) -> CapturedStep:
    """Captured steps with ``groups`` against plain training of a copy (SGD)."""
    torch.manual_seed(0)
    model = mlp([5, 8, 7, 6, 4]).to(device)
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=3, balance=[2, 2, 4], devices=[device] * 3, schedule=schedule)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(7, 5, generator=g, dtype=torch.float64).to(device),
            torch.randn(7, 4, generator=g, dtype=torch.float64).to(device),
        )
        for _ in range(steps + 1)
    ]
    step = CapturedStep(pipe, *data[0], nn.MSELoss(), optimizer=opt, groups=groups)
    assert_trains_like(step, pipe, ref, ref_opt, data[1:])
    return step


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize("groups", [[0, 1, 1], [0, 1, 2]])
def test_captured_steps_in_groups_on_the_cpu_equal_plain_training(
    schedule: str, groups: list[int]
) -> None:
    step = _steps("cpu", schedule, groups)
    assert not step.captured and step.launches == 0


def test_groups_are_checked_at_construction() -> None:
    pipe = Pipe(mlp([5, 8, 4]), split_size=3, balance=[1, 3], devices=["cpu"] * 2)
    x, y = torch.randn(6, 5), torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"one label per stage \(2\), got 3"):
        CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 1, 1])
    with pytest.raises(ValueError, match="a memory pool of its own"):
        CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 1], pool=object())


@pytest.mark.cuda
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_captured_steps_in_groups_on_one_gpu_equal_plain_training(schedule: str) -> None:
    step = _steps("cuda:0", schedule, [0, 1, 2])
    cut = segment(step.pipe.schedule_for(3, torch.device("cuda:0"), training_step=True), [0, 1, 2])
    assert step.captured and step.launches == len(cut.parts) + 2
    with pytest.raises(RuntimeError, match="no one pool"):
        _ = step.pool


def test_dropout_in_two_groups_is_refused() -> None:
    model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.1), nn.Linear(8, 8), nn.Dropout(0.1))
    pipe = Pipe(model, split_size=3, balance=[2, 2], devices=["cpu"] * 2)
    x, y = torch.randn(6, 5), torch.randn(6, 8)
    with pytest.raises(ValueError, match=r"dropout in stage 0 \(group 0\) and stage 1 \(group 1\)"):
        CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 1])
    CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 0])  # one group draws them all
    pipe.eval()
    CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 1])  # no dropout in eval mode


@pytest.mark.cuda
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_groups_graphs_overlap_at_replay(schedule: str) -> None:
    """Calibrated GPU sleeps: the replayed segments of two groups on one GPU
    take a pipeline's time, not a serial run's."""
    from tests.cuda.helpers import SleepStage, cycles_per_ms, time_ms

    stage_ms, micros = 2.0, 8
    cycles = int(cycles_per_ms() * stage_ms)
    pipe = Pipe(
        nn.Sequential(SleepStage(cycles, cycles), SleepStage(cycles, cycles)),
        chunks=micros, devices=["cuda:0", "cuda:0"], schedule=schedule,
    )  # fmt: skip
    x, y = torch.zeros(micros, 4, device="cuda"), torch.zeros(micros, 4, device="cuda")
    step = CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 1], warmup=1)
    measured = time_ms(lambda: step(x, y))
    serial = 2 * micros * 2 * stage_ms
    ideal = 2 * (micros + 1) * stage_ms
    assert measured < 0.75 * serial, (measured, serial, ideal)
    assert measured > 0.9 * ideal, (measured, ideal)


def test_a_tensor_shared_by_two_groups_is_refused() -> None:
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight  # tied
    pipe = Pipe(nn.Sequential(first, nn.ReLU(), last), balance=[2, 1], devices=["cpu"] * 2)
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"'0.weight' of stage 0 \(group 0\) is shared with "):
        CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 1])
    CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 0])


class Noisy(nn.Module):
    """Dropout no module check can see: a functional call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, 0.5, self.training)


def test_random_numbers_drawn_in_two_groups_are_seen_in_a_step_and_refused() -> None:
    model = nn.Sequential(nn.Linear(5, 8), Noisy(), nn.Linear(8, 8), Noisy())
    pipe = Pipe(model, split_size=3, balance=[2, 2], devices=["cpu"] * 2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in pipe.parameters()]
    x, y = torch.randn(6, 5), torch.randn(6, 8)
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"random numbers in stage 0 \(group 0\) and stage 1"):
        CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt, groups=[0, 1])
    # The step that showed it is undone.
    assert all(p.grad is None for p in pipe.parameters()) and not opt.state
    for p, b in zip(pipe.parameters(), before):
        torch.testing.assert_close(p.detach(), b)
    assert torch.equal(torch.get_rng_state(), rng)
    CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt, groups=[0, 0])
    pipe.eval()
    CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt, groups=[0, 1])  # no draws in eval


def test_a_torch_without_external_events_is_refused_up_front(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Old:
        def __new__(cls, enable_timing: bool = False, blocking: bool = False) -> Old:
            return object.__new__(cls)

    check_external_events()  # this torch has them
    monkeypatch.setattr(torch.cuda, "Event", Old)
    with pytest.raises(RuntimeError, match=r"needs torch.cuda.Event\(external=True\)"):
        check_external_events()


@pytest.mark.cuda
def test_back_to_back_replays_without_a_host_sync_train_like_eager_steps() -> None:
    """External waits bind to the producer's record of the same step, replay
    after replay, with nothing synchronising the host in between."""
    torch.manual_seed(0)
    model = mlp([5, 8, 7, 6, 4]).cuda()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=3, balance=[2, 2, 4], devices=["cuda:0"] * 3, schedule="1f1b")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(7, 5, generator=g, dtype=torch.float64).cuda(),
            torch.randn(7, 4, generator=g, dtype=torch.float64).cuda(),
        )
        for _ in range(30)
    ]
    step = CapturedStep(pipe, *data[0], nn.MSELoss(), optimizer=opt, groups=[0, 1, 2])
    losses = [step(x, y) for x, y in data]  # no host sync in between
    expected = []
    for x, y in data:
        ref_opt.zero_grad()
        loss = nn.MSELoss()(ref(x), y)
        loss.backward()
        ref_opt.step()
        expected.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected))
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())


class FailsInCapture(nn.Module):
    """Runs eagerly; inside a capture it fails, as ``how`` says."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            if self.how == "raise":
                raise ValueError("stage failed")
            x.sum().item()  # a host sync: invalidates the capture
        return x


@pytest.mark.cuda
@pytest.mark.parametrize("how", ["raise", "item"])
def test_a_capture_that_fails_in_a_segment_leaves_torch_and_the_pipe_working(how: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), FailsInCapture(how), nn.Linear(8, 4)).cuda()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=3, balance=[2, 1], devices=["cuda:0"] * 2)
    x, y = torch.randn(6, 5, device="cuda"), torch.randn(6, 4, device="cuda")
    expected = ValueError if how == "raise" else RuntimeError
    with pytest.raises(expected):
        CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 1])
    assert all(p.grad is None for p in pipe.parameters())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no capture left underway in the allocator
    nn.functional.dropout(torch.ones(4, device="cuda"), 0.5)  # the generator is out of capture
    loss = pipe.train_step(x, y, nn.MSELoss())  # eager steps still work
    reference = nn.MSELoss()(ref(x), y)
    reference.backward()
    torch.testing.assert_close(loss, reference.detach())
    assert_same_grads(pipe, ref)

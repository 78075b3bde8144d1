"""Which devices a step is captured on, and DeviceGraphs: what one call
issues on each device captured as a graph there, side by side, replayed
on each device's current stream (fake streams and graphs on the CPU; real
ones on GPUs)."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn

from mpstream import CapturedStep, Pipe
from mpstream.capture.devices import DeviceGraphs, capture_devices
from tests.capture.fakes import D0, D1, World
from tests.helpers import mlp

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)


def test_the_devices_a_step_is_captured_on() -> None:
    cpu = torch.device("cpu")
    assert capture_devices([cpu, cpu], graphed=False) == []
    assert capture_devices([D0, D0], graphed=False) == [D0]
    assert capture_devices([D0, D1, D0], graphed=True) == [D0, D1]
    with pytest.raises(ValueError, match="cannot replay one CUDA graph across devices"):
        capture_devices([D0, D1], graphed=False)
    with pytest.raises(ValueError, match="build the pipe with graphs=True"):
        capture_devices([D0, D1], graphed=False)
    with pytest.raises(ValueError, match="every stage on CPUs: stages are on cpu, cuda:0"):
        capture_devices([cpu, D0], graphed=True)


def test_each_devices_share_is_captured_on_a_side_stream_and_nothing_runs() -> None:
    world = World()

    def fn() -> None:
        world.work(D0, "a")
        world.work(D1, "b")

    graphs = DeviceGraphs(fn, [D0, D1], world.cuda())
    log = world.log
    assert not [e for e in log if e[0] == "ran"]  # captured, not run
    assert ("captured", "a", 0, "side1") in log and ("captured", "b", 1, "side2") in log
    # Side by side on two devices: relaxed; each side starts after its device's stream.
    assert [e for e in log if e[0] == "begin"] == [
        ("begin", 0, "side1", "relaxed"),
        ("begin", 1, "side2", "relaxed"),
    ]
    begin = log.index(("begin", 0, "side1", "relaxed"))
    assert log.index(("wait_stream", "side1", "main0")) < begin
    # ... and each device's stream continues after it (eager work on the side
    # streams, a capture's generator prologue before torch 2.13, is ordered).
    assert log[-2:] == [("wait_stream", "main0", "side1"), ("wait_stream", "main1", "side2")]
    assert [s.name for s in world.current.values()] == ["main0", "main1"]
    assert graphs.launches == 2
    world.log.clear()
    graphs.replay()
    assert world.log == [("replay", 0, "main0"), ("replay", 1, "main1")]


def test_one_device_captures_thread_local_and_replays_on_the_current_stream() -> None:
    world = World((D0,))
    graphs = DeviceGraphs(lambda: world.work(D0), [D0], world.cuda())
    assert [e[-1] for e in world.log if e[0] == "begin"] == ["thread_local"]
    side = world.stream(D0)
    world.log.clear()
    with world.use(side):  # the caller's stream of the moment
        graphs.replay()
    assert world.log == [("replay", 0, side.name)]


def test_a_device_the_call_issues_nothing_on_gets_no_graph() -> None:
    world = World()
    graphs = DeviceGraphs(lambda: world.work(D1), [D0, D1], world.cuda())
    assert graphs.launches == 1 and list(graphs.graphs) == [D1]
    assert DeviceGraphs(lambda: None, [], world.cuda()).launches == 0


@pytest.mark.parametrize("where", ["start", "call", "end"])
def test_a_failure_undoes_every_capture_and_propagates(where: str) -> None:
    world = World()

    def fn() -> None:
        if where == "start":  # as Adam's capture check does: the graphs stay empty
            raise ValueError("the optimizer refused")
        world.work(D0)
        world.work(D1)
        if where == "call":
            raise ValueError("the optimizer failed")
        world.graphs[0].fail_end = True

    with pytest.raises((ValueError, RuntimeError)), warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "graph is empty" is no news then
        DeviceGraphs(fn, [D0, D1], world.cuda())
    log = world.log
    assert not world.capturing and ("end", 0) in log and ("end", 1) in log  # both ended
    if where == "end":  # the graph whose end failed is undone; the other ends as usual
        assert [e for e in log if e[0] in ("keep", "reset_generator")] == [
            ("keep", 0),
            ("reset_generator",),
        ]
    assert not [e for e in log if e[0] == "ran"]
    assert [s.name for s in world.current.values()] == ["main0", "main1"]


def _two_gpu_pipe(schedule: str) -> tuple[Pipe, nn.Module]:
    torch.manual_seed(0)
    model = mlp([6, 16, 16, 4]).double()
    ref = copy.deepcopy(model)  # trained on the CPU
    pipe = Pipe(
        model, chunks=3, balance=[2, 4], devices=["cuda:0", "cuda:1"], schedule=schedule,
        graphs=True,
    )  # fmt: skip
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
    step = CapturedStep(pipe, *batches[0], nn.MSELoss(), optimizer=opt)
    # Micro-batches of 3, 3 and 1, each a forward and a backward graph per
    # stage (zb_h1: B and W, no B for the first stage), and a zeroing and an
    # update graph per device.
    per_micro = 2 + 1 + 2 if schedule == "zb_h1" else 2 + 2
    assert step.captured and step.launches == 3 * per_micro + 4
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


@pytest.mark.cuda
@two_gpus
def test_two_gpus_without_graphed_stages_are_refused() -> None:
    torch.manual_seed(0)
    pipe = Pipe(mlp([6, 16, 4]).double(), chunks=3, balance=[2, 2], devices=["cuda:0", "cuda:1"])
    x, y = torch.randn(6, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="build the pipe with graphs=True"):
        CapturedStep(pipe, x, y, nn.MSELoss())


@pytest.mark.cuda
def test_relaxed_captures_open_side_by_side_on_one_gpu_end_in_order() -> None:
    # What DeviceGraphs does on two GPUs, on the one GPU a test machine may
    # have: two relaxed captures open at once on two side streams, one of
    # them empty, ended first in, first out; torch's empty-graph warning taken.
    from mpstream.capture.devices import _sorted_warnings
    from mpstream.runtime.graphed.capturing import capturing

    x = torch.ones(4, device="cuda")
    sides = [torch.cuda.Stream() for _ in range(2)]  # type: ignore[no-untyped-call]
    graphs = [torch.cuda.CUDAGraph() for _ in range(2)]
    stacks = []
    for side, graph in zip(sides, graphs):
        side.wait_stream(torch.cuda.current_stream())
        stack = contextlib.ExitStack()
        with torch.cuda.stream(side):
            stack.enter_context(capturing(graph, torch.cuda.graph_pool_handle(), None, "relaxed"))
        stacks.append(stack)
    with torch.cuda.stream(sides[0]):
        y = x * 2  # only the first capture gets work
    empty: set[torch.device] = set()
    for side, stack in zip(sides, stacks):
        with torch.cuda.stream(side), _sorted_warnings(torch.device("cuda:0"), empty):
            stack.close()
    for side in sides:
        torch.cuda.current_stream().wait_stream(side)
    assert empty == {torch.device("cuda:0")}  # the second capture was empty
    graphs[0].replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x * 2)
    torch.ones(1, device="cuda").mul_(2)  # eager work still runs: nothing left capturing

"""GraphEdges, checked on the CPU with fake CUDA objects that log: a step is
captured as prologue, one graph per segment on its group's launch stream,
and epilogue; external events are recorded and waited on inside segment
captures only; a replay launches in order with the streams ordered around
it; a failure ends the open capture and leaves the pipe as it was."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.capture.edges import GraphEdges
from mpstream.schedules.segments import segment
from tests.capture.fakes import CPU, World
from tests.helpers import assert_same_grads, mlp


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

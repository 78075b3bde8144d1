"""Schedules as text: every built-in round-trips through its text form; a
user-given order is checked and a bad one rejected with a stage x step grid;
Pipe trains with user orders, split backwards included."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.schedules.orders import Action, format_order, grid, is_order, parse
from mpstream.schedules.schedule import SCHEDULES, Schedule, Topology, schedule_arg
from tests.helpers import assert_same_grads, clone, fits, mlp, virtual_for

UNET = Topology(((-1,), (0,), (0, 1), (0, 2)), (0, 1, 0, 1), -1)


def native(sched: Schedule) -> list[tuple[object, ...]]:
    return [(t.kind, t.stage, t.peer, t.micro, t.deps) for t in sched.tasks]


CASES = [
    (layout, stages, micros)
    for layout in ("chain", "copies")
    for stages, micros in [(1, 1), (2, 3), (4, 4), (4, 7)]
] + [("graph", 4, 1), ("graph", 4, 5)]


@pytest.mark.parametrize(
    ("name", "layout", "stages", "micros"),
    [(n, *case) for n in SCHEDULES for case in CASES if fits(n, case[1])],
)
def test_built_in_schedules_round_trip(name: str, layout: str, stages: int, micros: int) -> None:
    topology = {
        "chain": Topology.chain([False] * stages),
        "copies": Topology.chain([True] * stages),
        "graph": UNET,
    }[layout]
    virtual = virtual_for(name, stages)
    built = Schedule(name, stages, micros, topology, backward=True, virtual_stages=virtual)
    text = str(built)
    assert text == format_order(parse(text))
    again = Schedule(text, stages, micros, topology)
    assert again.name == "custom"
    # Same tasks, copies included, in the same order with the same deps.
    assert native(again) == native(built)
    assert Schedule(text.split(), stages, micros, topology).order == built.order


def test_text_form() -> None:
    sched = Schedule("1f1b", 2, 2, [False, False])
    assert str(sched) == "F0m0 F1m0 F0m1 B1m0 B0m0 F1m1 B1m1 B0m1"
    assert parse("F0m3, B12m0\nW1m2") == (Action("F", 0, 3), Action("B", 12, 0), Action("W", 1, 2))
    with pytest.raises(ValueError, match="'f0m3' is not a schedule action"):
        parse(["F0m0", "f0m3"])
    with pytest.raises(ValueError, match="empty"):
        parse([])
    with pytest.raises(TypeError, match="strings like 'F0m3'"):
        parse([3])  # type: ignore[list-item]


def test_an_order_written_with_commas_alone_is_an_order() -> None:
    # parse reads commas as separators; a text without spaces is still an
    # order, not an unknown schedule's name.
    text = "F0m0,F1m0,B1m0,B0m0"
    assert is_order(text) and not is_order("1f1b")
    assert str(Schedule(text, 2, 1, [False, False])) == "F0m0 F1m0 B1m0 B0m0"
    assert schedule_arg(text) == ("F0m0", "F1m0", "B1m0", "B0m0")
    model = mlp([2, 2, 2])
    pipe = Pipe(clone(model), balance=[2, 2], devices=["cpu"] * 2, schedule=text)
    x, y = torch.randn(3, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    torch.testing.assert_close(pipe.train_step(x, y, nn.MSELoss()), loss.detach())
    assert_same_grads(pipe, model)


def bad(order: list[str], stages: int = 2, micros: int = 2) -> str:
    with pytest.raises(ValueError) as info:
        Schedule(order, stages, micros, [False] * stages)
    return str(info.value)


def test_bad_orders_are_rejected_with_a_marked_grid() -> None:
    order = str(Schedule("1f1b", 3, 2, [False] * 3)).split()
    order[2], order[5] = order[5], order[2]  # B2m0 before F2m0
    message = bad(order, 3)
    assert message.startswith("invalid schedule order: B2m0 needs F2m0, which comes later")
    assert "stage x step grid" in message and "[ ] marks step 2" in message
    rows = message.splitlines()
    assert rows[-1].startswith("stage 2") and "[B0]" in rows[-1]
    assert rows[-4].split() == ["step", *map(str, range(len(order)))]

    ok = ["F0m0", "F1m0", "B1m0", "B0m0", "F0m1", "F1m1", "B1m1", "B0m1"]
    assert "B0m0 needs B1m0" in bad(["F0m0", "F1m0", "B0m0", "B1m0", *ok[4:]])
    assert "F1m0 appears twice (first at step 1)" in bad([*ok, "F1m0"])
    assert "has no B0m1" in bad(ok[:-1])
    assert "no stage 2 (stages 0-1)" in bad([*ok, "F2m0"])
    assert "W1m0 needs B1m0" in bad(["F0m0", "F1m0", "W1m0", "B1m0", *ok[3:]])
    assert "covers 2 micro-batch(es)" in bad(ok, micros=3)
    # A weight action is optional: without it B is the whole backward.
    Schedule([*ok[:3], "W1m0", *ok[3:]], 2, 2, [False, False])


def test_the_grid_wraps_long_orders() -> None:
    order = Schedule("gpipe", 2, 20, [False, False], backward=True).order
    text = grid(order, 2, mark=30)
    blocks = text.split("\n\n")
    assert len(blocks) == 4 and "[F14]" in blocks[1]
    assert all(block.splitlines()[1].startswith("stage 0") for block in blocks)


def test_graph_orders_check_every_read() -> None:
    order = str(Schedule("1f1b", 4, 1, UNET)).split()
    assert order[:4] == ["F0m0", "F1m0", "F2m0", "F3m0"]
    swapped = ["F0m0", "F2m0", "F1m0", *order[3:]]
    with pytest.raises(ValueError, match=r"F2m0 needs F1m0 \(stage 2 reads stage 1's output\)"):
        Schedule(swapped, 4, 1, UNET)


BATCH = 10


def data() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 4, dtype=torch.float64)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_pipe_trains_with_a_user_order(checkpoint: str) -> None:
    # 1F1B by hand, where stage 1 defers one weight pass and stage 0 splits
    # only micro-batch 0's backward.
    order = "F0m0 F1m0 F0m1 B1m0 F1m1 B0m0 W0m0 F0m2 B1m1 W1m0 F1m2 B0m1 B1m2 W1m1 B0m2 W1m2"
    model = mlp([5, 8, 7, 4])
    ref = copy.deepcopy(model)
    pipe = Pipe(
        model,
        chunks=3,
        balance=[2, 4],
        devices=["cpu", "cpu"],
        schedule=order,
        checkpoint=checkpoint,
    )
    assert pipe.schedule == tuple(order.split())
    x, y = data()
    loss = pipe.train_step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)
    sched = pipe.schedule_for(3, x.device, training_step=True)
    assert sched.split == {(0, 0), (1, 0), (1, 1), (1, 2)}
    assert str(sched) == order


def test_pipe_checks_an_order_when_built_and_when_run() -> None:
    with pytest.raises(ValueError, match="no action of stage 1, but the run has 2 stages"):
        Pipe(mlp([5, 4]), chunks=1, balance=[1, 1], devices=["cpu"] * 2, schedule="F0m0 B0m0")
    with pytest.raises(ValueError, match="not a schedule action"):
        Pipe(mlp([5, 4]), balance=[1, 1], devices=["cpu"] * 2, schedule=["F0m0", "backward"])
    pipe = Pipe(
        mlp([5, 6, 4]),
        chunks=3,
        balance=[2, 2],
        devices=["cpu"] * 2,
        schedule="F0m0 F1m0 B1m0 B0m0",
    )
    x, y = data()
    with pytest.raises(ValueError, match="covers 1 micro-batch.* the run has 3"):
        pipe.train_step(x, y, nn.MSELoss())
    assert all(p.grad is None for p in pipe.parameters())
    pipe.chunks = 1
    pipe.train_step(x, y, nn.MSELoss())  # the next call works


def test_a_stage_out_of_range_is_named_before_the_micro_batch_count() -> None:
    with pytest.raises(ValueError, match=r"F9m0 names no stage 9 \(stages 0-1\)"):
        Schedule(["F9m0", "B9m0"], 2, 2, [False, False])
    with pytest.raises(ValueError, match="what chunks= or split_size= makes of the batch"):
        Schedule(["F0m0", "F1m0", "B1m0", "B0m0"], 2, 2, [False, False])


def test_an_order_for_fewer_stages_names_the_stages_it_lacks() -> None:
    # An order written for 3 stages given to 4: the missing stage is named
    # up front, not as the first action that needs it (B2m0 needs B3m0).
    three = str(Schedule("1f1b", 3, 2, [False] * 3))
    with pytest.raises(ValueError, match=r"no action of stage 3, but the run has 4 stages"):
        Pipe(mlp([5, 6, 6, 6, 4]), chunks=2, balance=[2] * 4, devices=["cpu"] * 4, schedule=three)
    # A stage left out in the middle.
    two = "F0m0 F2m0 B2m0 B0m0"
    with pytest.raises(ValueError, match=r"no action of stage 1, .*: give an order for 3 stages"):
        Schedule(two, 3, 1, [False] * 3)


def test_a_schedule_object_given_as_an_order_says_to_pass_its_text() -> None:
    # What schedule_for returns, passed back as is: simulate and record_plan
    # said "'Schedule' object is not iterable", Pipe listed the built-ins.
    from mpstream import record_plan, simulate

    sched = Schedule("zb_h1", 2, 2, [False, False])
    match = r"got Schedule: pass str\(\) of it \('F0m0 F1m0 F0m1"
    with pytest.raises(TypeError, match=match):
        Pipe(mlp([5, 6, 4]), chunks=2, balance=[2, 2], devices=["cpu"] * 2, schedule=sched)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=match):
        simulate([(1.0, 1.0)] * 2, chunks=2, schedule=sched)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=match):
        record_plan(sched, 2, 2, ["cpu", "cpu"], backward=True)  # type: ignore[arg-type]
    assert simulate([(1.0, 1.0)] * 2, chunks=2, schedule=str(sched)).step_ms > 0

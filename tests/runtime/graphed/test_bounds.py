"""Graphed calls a stage keeps (:mod:`mpstream.runtime.graphed.state`, through
a pipe): bounded by ``max_calls``, dropped for room together at the next
run, readers' calls gone with their producers', recaptures counted, and the
static buffers the report counts.

On the CPU the replays are emulated, as in test_stages.py."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated, GraphWarning, StageGraphs
from mpstream.runtime.graphed import call as call_module
from mpstream.runtime.graphed import state as state_module
from tests.helpers import assert_same_grads, mlp
from tests.runtime.graphed.pairs import WIDTHS, data, pair


def test_graphed_calls_are_bounded() -> None:
    eager, graphed = pair(mlp(WIDTHS), chunks=1)
    graphs = graphed._rt().worker.graphs
    assert isinstance(graphs, StageGraphs)
    graphs.max_calls = 2
    with torch.no_grad():
        for batch in range(1, 6):  # a new shape each time: a new signature
            graphed(torch.randn(batch, WIDTHS[0], dtype=torch.float64))
    assert all(len(s.calls) <= 2 for s in graphs.stages)
    # Forwards kept without their backward (an evaluation loop with gradients
    # on): past the bound they run eagerly, with one warning per stage.
    x, y = data()
    with pytest.warns(GraphWarning, match="max_calls=2 graphed calls in use; further such calls"):
        kept = [graphed(x) for _ in range(4)]
    for out in kept:
        torch.testing.assert_close(out, eager(x))
    assert all(len(s.calls) <= 2 for s in graphs.stages)


def test_calls_dropped_for_room_go_with_the_stages_others_at_the_next_run() -> None:
    # A dropped call's graphs wait for those captured on its stream (torch
    # 2.11's destructor drops the stream's cuBLAS workspace): the next run
    # that leaves none busy drops the stage's calls together, freeing them.
    eager, graphed = pair(mlp(WIDTHS), chunks=1)
    graphs = graphed._rt().worker.graphs
    assert isinstance(graphs, StageGraphs)
    graphs.max_calls = 2
    with torch.no_grad():
        for batch in (1, 2, 3):  # the third drops the first for room
            graphed(torch.randn(batch, WIDTHS[0], dtype=torch.float64))
        assert all(len(s.calls) == 2 and s.evicted for s in graphs.stages)
        x = torch.randn(3, WIDTHS[0], dtype=torch.float64)
        torch.testing.assert_close(graphed(x), eager(x))  # all dropped, one captured again
    assert all(len(s.calls) == 1 and not s.evicted for s in graphs.stages)
    assert all(s.recaptures == 1 for s in graphed.graph_report().stages)


@pytest.mark.parametrize("loop", ["train_step", "own"])
def test_readers_calls_go_with_the_producer_calls_they_read(loop: str) -> None:
    # A reader's graphs read its producer's buffers in place and their keys
    # name its call: once the producer's calls are dropped (a parameter
    # replaced, here), nothing finds them again, and kept they would hold the
    # old producer's graphs, buffers and gradient buffers alive.
    model = mlp(WIDTHS)
    graphed = Pipe(
        copy.deepcopy(model), balance=[2, 2, 2, 2], devices=["cpu"] * 4, graphs=Emulated(),
        split_size=3,
    )  # fmt: skip
    graphs = graphed._rt().worker.graphs
    assert isinstance(graphs, StageGraphs)
    x, y = data(12)
    seen: list[weakref.ref[call_module.GraphedCall]] = []
    alive: list[int] = []
    for _ in range(4):
        for module in (graphed, model):
            module.zero_grad()
        if loop == "train_step":
            loss = graphed.train_step(x, y, nn.MSELoss())
        else:
            loss = nn.functional.mse_loss(graphed(x), y)
            loss.backward()
        expected = nn.functional.mse_loss(model(x), y)
        expected.backward()
        torch.testing.assert_close(loss, expected)
        assert_same_grads(graphed, model)
        first = graphed.partitions[0][0]
        first.weight = nn.Parameter(first.weight.detach().clone())  # stage 0's calls go
        seen += [weakref.ref(c) for st in graphs.stages for c in st.calls.values()]
        gc.collect()
        alive.append(sum(ref() is not None for ref in seen))
    assert alive == alive[:1] * 4
    assert all(len(st.calls) == 4 for st in graphs.stages)  # one slot per micro-batch


def test_a_reader_call_kept_for_its_pending_backward_goes_once_that_ran() -> None:
    model = mlp(WIDTHS)
    graphed = Pipe(copy.deepcopy(model), balance=[4, 4], devices=["cpu"] * 2, graphs=Emulated())
    graphs = graphed._rt().worker.graphs
    assert isinstance(graphs, StageGraphs)
    x, y = data()
    old = []
    for module in (graphed, model):
        loss = nn.functional.mse_loss(module(x), y)  # stage 1 reads stage 0's buffer in place
        first = module[0] if module is model else graphed.partitions[0][0]
        old.append(first.weight)
        first.weight = nn.Parameter(first.weight.detach().clone())  # stage 0's calls go
        with torch.no_grad():
            module(x)
        if module is graphed:
            reader = [weakref.ref(c) for c in graphs.stages[1].calls.values() if c.sources]
            assert reader and all(ref() is not None for ref in reader)  # its backward is pending
        loss.backward()
    torch.testing.assert_close(old[0].grad, old[1].grad)
    for (name, p), q in zip(graphed.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), model(x))
    gc.collect()
    assert all(ref() is None for ref in reader)


def test_recaptures_count_captures_a_replaced_tensor_caused() -> None:
    _, graphed = pair(mlp(WIDTHS), chunks=2)
    x, y = data()
    for batch in (10, 8, 6):  # three shapes: graphs for each
        nn.functional.mse_loss(graphed(x[:batch]), y[:batch]).backward()
    first = graphed.partitions[0][0]
    first.weight = nn.Parameter(first.weight.detach().clone())
    nn.functional.mse_loss(graphed(x), y).backward()  # one shape again
    stage = graphed.graph_report().stages[0]
    assert stage.recaptures == 2  # its forward and backward for that shape, not all dropped


@pytest.mark.parametrize("split_size", [3, 4])  # batches of 6, 5, 4, 3: some divide
def test_recaptures_count_every_capture_again_once_its_key_was_forgotten(
    monkeypatch: pytest.MonkeyPatch, split_size: int
) -> None:
    # Past the bound on numbered keys a stage forgets the keys no kept call
    # holds: those of calls dropped (a replaced tensor) still count when
    # captured again, as they do before the bound is reached.
    monkeypatch.setattr(state_module, "_NUMBERS_KEPT", 2)
    eager, graphed = pair(mlp(WIDTHS), split_size=split_size)
    x, y = data()

    def step(batch: int) -> None:
        losses = []
        for pipe in (eager, graphed):
            pipe.zero_grad()
            losses.append(pipe.train_step(x[:batch], y[:batch], nn.functional.mse_loss))
        torch.testing.assert_close(losses[1], losses[0])
        assert_same_grads(graphed, eager)

    for batch in (6, 5):  # 3 keys (slot and shape) in stage 0
        step(batch)
    for pipe in (eager, graphed):
        first = pipe.partitions[0][0]
        first.weight = nn.Parameter(first.weight.detach().clone())  # stage 0's calls go
    for batch in (4, 3, 6, 5):  # a new key among them: the dropped ones are forgotten
        step(batch)
    stage = graphed.graph_report().stages[0]
    assert (stage.captures, stage.recaptures) == (7, 3)  # each of the 3 keys again, 1 new


def _held(pipe: Pipe) -> int:
    """Bytes of every static buffer the pipe's graphed calls hold, storages
    counted once over the whole pipe (a reader's in-place input is its
    producer's output)."""
    graphs = pipe._rt().worker.graphs
    assert graphs is not None
    calls = [c for st in graphs.stages for c in st.calls.values()]
    buffers = [
        t
        for c in calls
        for t in (*c.static_in, *c.static_out, *c.static_grad_out, *c.static_grad_in)
        if t is not None
    ]
    return sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in buffers}.values()
    )


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        # Stage 0: per slot its input (5x6), output and output gradient
        # (5x12). Stage 1 of gpipe reads stage 0's output in place and
        # writes its input gradient into stage 0's buffer: per slot its
        # output and output gradient (5x4). 1F1B's one slot of stage 1
        # copies in: its own input and input gradient (5x12) too.
        ("gpipe", [2 * (30 + 60 + 60) * 8, 2 * (20 + 20) * 8]),
        ("1f1b", [2 * (30 + 60 + 60) * 8, (60 + 20 + 20 + 60) * 8]),
    ],
)
def test_the_report_counts_the_static_buffers_outside_the_pools(
    schedule: str, expected: list[int]
) -> None:
    _, graphed = pair(mlp(WIDTHS), split_size=5, schedule=schedule)
    x, y = data()
    for _ in range(2):
        graphed.train_step(x, y, nn.MSELoss())
    report = graphed.graph_report()
    assert [s.static_bytes for s in report.stages] == expected
    assert sum(expected) == _held(graphed)
    with torch.no_grad():  # calls of their own: inputs and outputs copied out
        graphed(x)
    report = graphed.graph_report()
    assert sum(s.static_bytes for s in report.stages) == _held(graphed) > sum(expected)
    assert "static" in str(report)

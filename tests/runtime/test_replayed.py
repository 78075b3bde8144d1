"""A training step's graphed stages: tasks without autograd, and what passes
between them uncopied (the next stage reads the producer's output buffer in
place and writes the gradient into its output-gradient buffer, where every
slot of the reader takes one slot of the producer), equal to the eager pipe."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.runtime import boundary, replayed, training
from mpstream.runtime.graphed import Emulated, GraphedCall, GraphWarning
from tests.helpers import Ops, assert_same_grads, mlp
from tests.pipe.test_pipe import _Abs, _Fft
from tests.runtime.graphed.pairs import WIDTHS, data, pair
from tests.runtime.graphed.test_grads import Silent

BALANCE = {1: [8], 2: [4, 4], 3: [2, 4, 2]}


def calls(pipe: object, stage: int) -> list[GraphedCall]:
    graphs = pipe._rt().worker.graphs  # type: ignore[attr-defined]
    return list(graphs.stages[stage].calls.values())


@pytest.mark.parametrize(("schedule", "in_place"), [("gpipe", True), ("1f1b", False)])
def test_a_stage_reads_its_producer_s_buffers_in_place_where_slots_pair(
    schedule: str, in_place: bool
) -> None:
    # gpipe: a slot per micro-batch on every stage; 1F1B: the last stage's
    # one slot takes micro-batches from both of the first stage's.
    eager, graphed = pair(mlp(WIDTHS), chunks=3, schedule=schedule)
    x, y = data()
    for _ in range(3):
        for pipe in (eager, graphed):
            pipe.train_step(x, y, nn.MSELoss())
        assert_same_grads(graphed, eager)
    producers, readers = calls(graphed, 0), calls(graphed, 1)
    outs = {c.static_out[0].data_ptr() for c in producers}
    grads = {id(c.static_grad_out[0]) for c in producers}
    read = {c.static_in[0].data_ptr() for c in readers}
    written = {id(c.static_grad_in[0]) for c in readers}
    assert (read <= outs) is in_place and (written <= grads) is in_place


def test_reading_in_place_saves_the_copies() -> None:
    counts = {}
    for schedule in ("gpipe", "1f1b"):
        _, graphed = pair(mlp(WIDTHS), graphs=Silent(), chunks=4, schedule=schedule)
        x, y = data(8)
        for _ in range(2):
            graphed.train_step(x, y, nn.MSELoss())
        with Ops() as seen:
            graphed.train_step(x, y, nn.MSELoss())
        counts[schedule] = seen.ops["copy_"]
    # Per micro-batch: the first stage's input copied in, the loss's gradient
    # copied into the last stage's buffer; with 1F1B also the hand-over both ways.
    assert counts == {"gpipe": 2 * 4, "1f1b": 4 * 4}


def test_an_eager_stage_between_replayed_ones_reads_copies_where_its_backward_splits() -> None:
    # Stage 1 cannot be captured: it reads stage 0's buffers, copied where
    # its weight pass may run after stage 0's next forward into that slot.
    from mpstream.runtime.graphed import Emulated

    backend = Emulated()
    real = backend.capture
    eager, graphed = pair(mlp([6, 8, 8, 8, 4]), graphs=backend, chunks=4, schedule="zb_h1",
                          balance=[2, 2, 4], devices=["cpu"] * 3)  # fmt: skip

    def refuse(call: GraphedCall, fn: object) -> None:
        if fn is graphed.partitions[1]:
            raise RuntimeError("not capturable")
        real(call, fn)  # type: ignore[arg-type]

    backend.capture = refuse  # type: ignore[method-assign]
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    with pytest.warns(UserWarning, match="runs eagerly: capture failed"):
        for _ in range(3):
            for pipe in (eager, graphed):
                pipe.train_step(x, y, nn.MSELoss())
    assert_same_grads(graphed, eager)
    assert [s.graphed for s in graphed.graph_report().stages] == [True, False, True]


class _Features(nn.Module):
    """Returns its features beside the head's output: a value of the result
    that the first stage produces."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        return self.b(h), h


class _ProjectedLoss(nn.Module):
    """A loss with a weight matrix of its own over the features: its
    gradient is a weight pass's work, which reads the features."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, 18, dtype=torch.float64).reshape(6, 3))

    def forward(self, out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        y, h = out
        return nn.functional.mse_loss(y, target) + (h @ self.w).pow(2).mean()


def check_loss_weight_over_a_replayed_output(backend: Any, device: str) -> None:
    """Zero-bubble, stage 0 replayed by ``backend`` on ``device``, the last
    stage eager (its capture refused), a loss with a weight matrix over stage
    0's output: loss, the loss's weight gradient and every parameter's
    against the plain model, over a capture and two replays."""
    torch.manual_seed(0)
    model = _Features().double().to(device)
    real = backend.capture
    sample = torch.randn(2, 6, dtype=torch.float64, device=device)
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], sample=sample, chunks=8,
                schedule="zb_h1", graphs=backend, devices=[device, device])  # fmt: skip

    def refuse(call: GraphedCall, fn: object) -> None:
        if fn is pipe.partitions[1]:
            raise RuntimeError("not capturable")
        real(call, fn)

    backend.capture = refuse
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 6, generator=g, dtype=torch.float64).to(device)
    y = torch.randn(16, 2, generator=g, dtype=torch.float64).to(device)
    with pytest.warns(GraphWarning, match="runs eagerly: capture failed"):
        for _ in range(3):  # captured, then replayed
            loss_fn, ref_fn = _ProjectedLoss().to(device), _ProjectedLoss().to(device)
            pipe.zero_grad()
            model.zero_grad()
            loss = pipe.train_step(x, y, loss_fn)
            expected = sum(ref_fn(model(a), b) for a, b in zip(x.chunk(8), y.chunk(8))) / 8
            expected.backward()  # type: ignore[union-attr]
            torch.testing.assert_close(loss, expected.detach())  # type: ignore[union-attr]
            torch.testing.assert_close(loss_fn.w.grad, ref_fn.w.grad)
            for (name, a), b in zip(pipe.named_parameters(), model.parameters()):
                torch.testing.assert_close(a.grad, b.grad, msg=name)
    assert [s.graphed for s in pipe.graph_report().stages] == [True, False]


def test_an_eager_last_stage_s_loss_reads_a_replayed_stage_s_output_copied() -> None:
    # Zero-bubble: the eager last stage's weight pass (the loss's weight
    # among it) ran after stage 0's next forward rewrote the slot's output
    # that the loss had read in place: version check failed here; on a GPU
    # a replay bumps no version, and the gradient would be silently wrong.
    check_loss_weight_over_a_replayed_output(Emulated(), "cpu")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_replayed_step_cuts_only_what_the_loss_reads(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A replayed stage's tasks cut nothing (no autograd graph; its input
    # gradients go straight into its producer's buffer): no Cutting per
    # task, only the last stage's outputs, once per micro-batch, for the loss.
    made: list[object] = []

    class Counted(boundary.Cutting):
        __slots__ = ()

        def __init__(self) -> None:
            made.append(self)
            super().__init__()

    for module in (training, replayed):
        monkeypatch.setattr(module, "Cutting", Counted)
    eager, graphed = pair(mlp(WIDTHS), chunks=3, schedule=schedule)
    x, y = data()
    for _ in range(2):
        for pipe in (eager, graphed):
            pipe.zero_grad()
            made.clear()
            pipe.train_step(x, y, nn.MSELoss())
        assert_same_grads(graphed, eager)
        assert len(made) == 3  # eager: one per stage and micro-batch (6)


@pytest.mark.parametrize("schedule", ["gpipe", "zb_h1"])
def test_complex_values_between_replayed_stages_carry_their_gradients(schedule: str) -> None:
    # A complex value needs its gradient as a floating one does: its
    # producer's parameters get theirs through it.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Fft(), _Abs(), nn.Linear(4, 1)).double()
    pipe = Pipe(copy.deepcopy(model), chunks=2, balance=[2, 2], devices=["cpu"] * 2,
                graphs=Emulated(), schedule=schedule)  # fmt: skip
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
    for _ in range(3):  # the second step on replays
        for net in (pipe, model):
            net.zero_grad()
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
        want = nn.functional.mse_loss(model(x), y)
        want.backward()
        torch.testing.assert_close(loss, want.detach())
        assert_same_grads(pipe, model)
    assert all(s.graphed for s in pipe.graph_report().stages)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_replayed_stages_with_every_parameter_frozen_are_refused_as_eager_ones(
    schedule: str, stages: int
) -> None:
    # A replayed stage's inputs were captured as needing a gradient whatever
    # they stood for: the loss of a frozen pipe had one, and nothing trained.
    model = mlp(WIDTHS).requires_grad_(False)
    pipe = Pipe(model, chunks=2, balance=BALANCE[stages], devices=["cpu"] * stages,
                graphs=Emulated(), schedule=schedule)  # fmt: skip
    x, y = data()
    for _ in range(2):  # captured, then replayed
        with pytest.raises(RuntimeError, match="loss_fn returned a loss that does not require"):
            pipe.train_step(x, y, nn.MSELoss())
    assert all(p.grad is None for p in pipe.parameters())


def test_a_replayed_stage_after_a_frozen_one_needs_no_input_gradient() -> None:
    # Its graphs are captured with an input that needs no gradient, as the
    # eager stage's input needs none: a split backward has no B pass.
    torch.manual_seed(0)
    model = mlp(WIDTHS)
    model[:2].requires_grad_(False)
    eager, graphed = pair(model, chunks=2, balance=[2, 4, 2], devices=["cpu"] * 3,
                          schedule="zb_h1")  # fmt: skip
    x, y = data()
    for _ in range(2):  # captured, then replayed
        losses = []
        for pipe in (eager, graphed):
            pipe.zero_grad()
            losses.append(pipe.train_step(x, y, nn.MSELoss()))
        torch.testing.assert_close(*losses)
        for (name, p), (_, q) in zip(graphed.named_parameters(), eager.named_parameters()):
            if q.grad is None:
                assert p.grad is None, name
            else:
                torch.testing.assert_close(p.grad, q.grad, msg=name)
    stages = graphed.graph_report().stages
    assert all(s.graphed for s in stages)
    # Stage 1 reads only what frozen stage 0 made: weights alone.
    assert [s.passes for s in stages[1:]] == [
        ("forward", "weight"),
        ("forward", "backward", "weight"),
    ]

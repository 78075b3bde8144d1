"""Which values a training step hands on with a gradient (``carried``),
against the plain model where that is easy to get wrong: a frozen stage
between trained ones, checkpointed producers, values a later stage or the
loss reads past the next stage (an integer one and a view among them),
graphed stages beside eager ones, and stages frozen and unfrozen between
steps. Eager stages on one device link their graphs where a value is not
cut, so a value wrongly left out of ``carried`` loses its gradient only
behind a copy (``force_copies``) or a replayed stage: both are run here.

The frozen pipe's refusals: tests/runtime/test_training.py."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated, GraphedCall
from mpstream.schedules import SCHEDULES
from tests.helpers import mlp, virtual_for

mse = nn.functional.mse_loss
# How the stages run: eager on one device, eager with every hand-over a
# copy (as across devices), replayed (emulated graphs).
RUNS = ["eager", "copies", "graphed"]


def options(run: str) -> dict[str, Any]:
    return {"force_copies": run == "copies", "graphs": Emulated() if run == "graphed" else False}


def train_as_the_plain_model(
    pipe: Pipe,
    ref: nn.Module,
    x: Tensor,
    y: Tensor,
    loss_fn: Callable[[Any, Tensor], Tensor],
    steps: int = 2,
    between: Callable[[int, nn.Module], None] | None = None,
) -> None:
    """``steps`` train steps of ``pipe`` give the loss and every parameter's
    gradient (None where the plain model's is) of ``ref``, the plain model;
    ``between(step, module)`` changes both before each step but the first."""
    for step in range(steps):
        if between is not None and step:
            between(step, pipe)
            between(step, ref)
        pipe.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        want = loss_fn(ref(x), y)
        want.backward()
        loss = pipe.train_step(x, y, loss_fn)
        torch.testing.assert_close(loss, want.detach())
        for (name, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters()):
            if q.grad is None:
                assert p.grad is None, f"step {step}: {name} got a gradient"
            else:
                assert p.grad is not None, f"step {step}: {name} got no gradient"
                torch.testing.assert_close(p.grad, q.grad, msg=f"step {step}: {name}")


def data(width: int = 5) -> tuple[Tensor, Tensor]:
    return torch.randn(8, width, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
@pytest.mark.parametrize("run", RUNS)
def test_gradients_cross_frozen_stages_to_the_trained_ones_before(
    schedule: str, checkpoint: str, run: str
) -> None:
    # Stages 1 and 2 frozen: what they hand on carries a gradient all the
    # same (their inputs do), which stage 0 needs.
    torch.manual_seed(0)
    model = mlp([5, 8, 7, 6, 4])
    model[2:6].requires_grad_(False)
    pipe = Pipe(copy.deepcopy(model), chunks=4, balance=[2, 2, 2, 2], devices=["cpu"] * 4,
                schedule=schedule, virtual_stages=virtual_for(schedule, 4),
                checkpoint=checkpoint, **options(run))  # fmt: skip
    train_as_the_plain_model(pipe, model, *data(), mse)


class Skips(nn.Module):
    """Stage 0's value is read by stages 2 and 3 and, as a view, by the
    loss; an integer value of it by stage 3."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))
        self.w = nn.Parameter(torch.ones(2))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.a(x)
        top = h.argmax(dim=1, keepdim=True)
        k = self.c(self.b(h)) * h
        return self.d(k) + top, h[:, :2] * self.w


def skips_loss(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    return mse(out[0], y) + out[1].square().mean()


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zbv"])
@pytest.mark.parametrize("frozen", ["a", "bcd", "acdw"])
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
@pytest.mark.parametrize("run", RUNS)
def test_values_read_past_the_next_stage_carry_their_gradients(
    schedule: str, frozen: str, checkpoint: str, run: str
) -> None:
    torch.manual_seed(0)
    model = Skips().double()
    for name in frozen:
        getattr(model, name).requires_grad_(False)
    pipe = Pipe(copy.deepcopy(model), chunks=4, split_points=["b", "c", "d"],
                devices=["cpu"] * 4, schedule=schedule, tracer="fx", checkpoint=checkpoint,
                virtual_stages=virtual_for(schedule, 4), **options(run))  # fmt: skip
    train_as_the_plain_model(pipe, model, *data(4), skips_loss)


@pytest.mark.filterwarnings("ignore:.*runs eagerly:UserWarning")
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "interleaved_1f1b"])
@pytest.mark.parametrize("eager", [{0}, {1}, {2}, {1, 3}])
@pytest.mark.parametrize("frozen", [0, 1, 2])
def test_graphed_and_eager_stages_side_by_side_hand_on_the_plain_model_s_gradients(
    schedule: str, eager: set[int], frozen: int
) -> None:
    # A replayed stage's values carry what its capture says, an eager one's
    # what autograd says: each reader, of either kind, takes the other's.
    torch.manual_seed(0)
    model = mlp([5, 8, 7, 6, 4])
    model[2 * frozen : 2 * frozen + 2].requires_grad_(False)
    backend = Emulated()
    real = backend.capture
    pipe = Pipe(copy.deepcopy(model), chunks=4, balance=[2, 2, 2, 2], devices=["cpu"] * 4,
                schedule=schedule, virtual_stages=virtual_for(schedule, 4),
                graphs=backend)  # fmt: skip

    def capture(call: GraphedCall, fn: Any) -> None:
        if any(fn is pipe.partitions[s] for s in eager):
            raise RuntimeError("not capturable")
        real(call, fn)

    backend.capture = capture  # type: ignore[method-assign]
    train_as_the_plain_model(pipe, model, *data(), mse, steps=3)
    graphed = [s.graphed for s in pipe.graph_report().stages]
    assert graphed == [s not in eager for s in range(4)]


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "interleaved_1f1b"])
@pytest.mark.parametrize("run", ["eager", "graphed"])
@pytest.mark.parametrize("block", [0, 1, 3])
def test_a_block_frozen_and_unfrozen_between_steps_trains_as_the_plain_model(
    schedule: str, run: str, block: int
) -> None:
    # Each step's graphs are found by what needs a gradient then: the
    # block's own (its parameters' flags) and its readers' (their inputs').
    torch.manual_seed(0)
    model = mlp([5, 8, 7, 6, 4])
    model[2 * block].requires_grad_(False)

    def switch(step: int, module: nn.Module) -> None:
        # Frozen, frozen, trained, trained, frozen.
        trained = step in (2, 3)
        for p in list(module.parameters())[2 * block : 2 * block + 2]:
            p.requires_grad_(trained)

    pipe = Pipe(copy.deepcopy(model), chunks=4, balance=[2, 2, 2, 2], devices=["cpu"] * 4,
                schedule=schedule, virtual_stages=virtual_for(schedule, 4),
                **options(run))  # fmt: skip
    train_as_the_plain_model(pipe, model, *data(), mse, steps=5, between=switch)


class Spread(nn.Module):
    """Hands on a dict: the value, an integer tensor and a view of the value."""

    def forward(self, h: Tensor) -> dict[str, Tensor]:
        return {"h": h, "top": h.argmax(dim=1, keepdim=True), "view": h[:, :2]}


class Through(nn.Module):
    """Changes the value, handing on the view and the integers unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, d: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"h": torch.tanh(self.lin(d["h"])), "top": d["top"], "view": d["view"]}


class Gather(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, d: dict[str, Tensor]) -> Tensor:
        extra = d["view"].sum(dim=1, keepdim=True) * d["top"]
        return self.lin(d["h"]) + extra  # type: ignore[no-any-return]


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
@pytest.mark.parametrize("frozen", [None, 2, 3])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("run", RUNS)
def test_dict_leaves_handed_on_unchanged_carry_their_gradients(
    schedule: str, frozen: int | None, checkpoint: str, run: str
) -> None:
    # Leaves past the first of an output: a view and integers, handed on
    # through a stage that may be frozen.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), Spread(), Through(), Gather()).double()
    if frozen is not None:
        model[frozen].requires_grad_(False)
    pipe = Pipe(copy.deepcopy(model), chunks=4, balance=[2, 1, 1], devices=["cpu"] * 3,
                schedule=schedule, checkpoint=checkpoint, **options(run))  # fmt: skip
    train_as_the_plain_model(pipe, model, *data(), mse)

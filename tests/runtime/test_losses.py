"""Tests of :mod:`mpstream.runtime.losses`: a step's losses, seeded by their weights."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import mpstream
from mpstream.runtime.graphed import Emulated
from mpstream.runtime.losses import Losses
from tests.helpers import Ops


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("weights", [[0.25, 0.25, 0.25, 0.25], [0.4, 0.4, 0.2, 0.0], [1.0] * 4])
def test_seeded_backward_and_total_equal_the_weighted_losses(weights: list[float]) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    losses = Losses(nn.MSELoss(), weights, None)
    expected = []
    for m in range(4):
        root = losses.compute(m, model(x[m : m + 1]), y[m : m + 1], None)
        torch.autograd.backward([root], [losses.seeds[m]])
        weighted = nn.MSELoss()(ref(x[m : m + 1]), y[m : m + 1]) * weights[m]
        weighted.backward()
        expected.append(weighted.detach())
    for got, want in zip(_grads(model), _grads(ref)):
        assert torch.equal(got, want)  # the same products, bit for bit
    torch.testing.assert_close(losses.total(None), torch.stack(expected).sum())
    assert not losses.total(None).requires_grad
    # One per micro-batch: a parameter's .grad may be a view of one (below).
    assert len({id(t) for t in losses.seeds.values()}) == 4


def test_scale_applies_to_the_root_not_to_the_total() -> None:
    model = nn.Linear(3, 1)
    losses = Losses(lambda out, _: out.sum(), [0.5], lambda t: t * 8)
    out = model(torch.ones(1, 3))
    root = losses.compute(0, out, None, None)
    torch.testing.assert_close(root.detach(), out.sum().detach() * 8)
    torch.testing.assert_close(losses.total(None), out.sum().detach() * 0.5)


def test_half_precision_losses_total_in_their_own_dtype() -> None:
    """Summed in float32 (as torch.sum of bfloat16 would), returned as the losses are."""
    losses = Losses(lambda out, _: out.sum(), [0.1] * 30, None)
    w = torch.ones(1, dtype=torch.bfloat16, requires_grad=True)
    for m in range(30):
        losses.compute(m, w * 1.0078125, None, None)
    total = losses.total(None)
    assert total.dtype == torch.bfloat16
    torch.testing.assert_close(total, torch.tensor(3.0234375).bfloat16())


@pytest.mark.parametrize(
    ("loss_fn", "error", "match"),
    [
        (lambda out, _: out, TypeError, r"scalar tensor, got a tensor of shape \(2, 1\)"),
        (lambda out, _: 1.0, TypeError, "scalar tensor, got float"),
        (lambda out, _: out.sum().detach(), RuntimeError, "does not require grad"),
    ],
)
def test_bad_losses_are_named(loss_fn: Any, error: type[Exception], match: str) -> None:
    losses = Losses(loss_fn, [1.0], None)
    with pytest.raises(error, match=match):
        losses.compute(0, nn.Linear(3, 1)(torch.ones(2, 3)), None, None)
    assert not losses.seeds  # nothing half-recorded
    with pytest.raises(RuntimeError, match="no loss"):
        losses.total(None)


def test_a_train_step_issues_no_operator_per_micro_batch_for_the_weights() -> None:
    """The weights cost no multiply per micro-batch, forward or backward."""
    torch.manual_seed(0)
    pipe = mpstream.Pipe(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=8, balance=[1, 1],
        devices=["cpu", "cpu"], schedule="1f1b",
    )  # fmt: skip
    x, y = torch.randn(16, 4), torch.randn(16, 4)
    with Ops() as seen:
        pipe.train_step(x, y, nn.MSELoss())
    assert seen.ops["mul"] <= 1 and seen.ops["ones_like"] == 0, seen.ops


class _Head(nn.Module):
    """A last stage with a learnable term its loss adds: ``s``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.s = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x)
        return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize("batch", [12, 10])  # even and uneven micro-batches
def test_a_loss_reaching_a_parameter_through_views_only(schedule: str, batch: int) -> None:
    """``mse + s.squeeze()``: the gradient ``s`` gets is a view of the seed,
    which autograd keeps as ``s.grad`` (nothing else holds it) and adds the
    next micro-batches' into in place; a seed shared by micro-batches would
    change under the backwards that start from it."""
    torch.manual_seed(0)
    head = _Head()
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), head).double()
    ref = copy.deepcopy(model)
    ref_head = ref[2]
    assert isinstance(ref_head, _Head)
    pipe = mpstream.Pipe(
        model, chunks=3, balance=[2, 1], devices=["cpu", "cpu"], schedule=schedule
    )  # fmt: skip
    x, y = torch.randn(batch, 5, dtype=torch.float64), torch.randn(batch, 3, dtype=torch.float64)
    got = pipe.train_step(x, y, lambda out, t: nn.functional.mse_loss(out, t) + head.s.squeeze())
    want = nn.functional.mse_loss(ref(x), y) + ref_head.s.squeeze()
    want.backward()  # type: ignore[no-untyped-call]
    torch.testing.assert_close(got, want.detach())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class _LossStage(nn.Module):
    """A last stage that computes the loss itself (as a model given labels does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x)
        return out.pow(2).mean()


@pytest.mark.parametrize("batch", [12, 10])
def test_a_loss_that_is_a_replayed_stages_output(batch: int) -> None:
    """``loss_fn`` returning the output of a replayed last stage returns its
    static buffer, which the next replay into that slot rewrites (1F1B reuses
    slots): the total must read each loss in its own task."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), _LossStage()).double()
    x = torch.randn(batch, 5, dtype=torch.float64)
    got = []
    for graphs in (False, Emulated()):
        pipe = mpstream.Pipe(
            copy.deepcopy(model), chunks=4, balance=[2, 1], devices=["cpu", "cpu"],
            schedule="1f1b", graphs=graphs,
        )  # fmt: skip
        got.append([pipe.train_step(x, None, lambda out, _: out) for _ in range(2)])
    want = torch.stack([model(c) * (len(c) / batch) for c in x.tensor_split(4)]).sum()
    for loss in (*got[0], *got[1]):
        torch.testing.assert_close(loss, want.detach())

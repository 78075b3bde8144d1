"""Tests of :mod:`mpstream.runtime.losses`: a step's losses, seeded by their weights."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mpstream
from mpstream.runtime.losses import Losses


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


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
    assert len({id(t) for t in losses.seeds.values()}) == len(set(weights))  # one per value


def test_scale_applies_to_the_root_not_to_the_total() -> None:
    model = nn.Linear(3, 1)
    losses = Losses(lambda out, _: out.sum(), [0.5], lambda t: t * 8)
    root = losses.compute(0, model(torch.ones(1, 3)), None, None)
    torch.testing.assert_close(root.detach(), losses.values[0] * 8)
    torch.testing.assert_close(losses.total(None), losses.values[0] * 0.5)


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
    assert not losses.values and not losses.seeds  # nothing half-recorded


def test_a_train_step_issues_no_operator_per_micro_batch_for_the_weights() -> None:
    """The weights cost no multiply per micro-batch, forward or backward."""
    torch.manual_seed(0)
    pipe = mpstream.Pipe(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=8, balance=[1, 1],
        devices=["cpu", "cpu"], schedule="1f1b",
    )  # fmt: skip
    x, y = torch.randn(16, 4), torch.randn(16, 4)
    with _Ops() as seen:
        pipe.train_step(x, y, nn.MSELoss())
    assert seen.ops["mul"] <= 1 and seen.ops["ones_like"] == 0, seen.ops

"""Layers sharing (tying) a parameter: allowed on one device, where gradients
accumulate from every use as in the plain model; rejected across devices."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpstream import Pipe
from tests.helpers import assert_same_grads

BATCH = 10


def tied_model() -> nn.Sequential:
    """Layer '4' reuses layer '0''s weight (as tied embeddings do)."""
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), last).double()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, 4, dtype=torch.float64), torch.randn(BATCH, 4, dtype=torch.float64)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_train_step_gradients_accumulate_from_both_uses(schedule: str, checkpoint: str) -> None:
    model = tied_model()
    ref = copy.deepcopy(model)
    pipe = Pipe(
        model,
        split_size=3,
        balance=[2, 1, 2],
        devices=["cpu"] * 3,
        schedule=schedule,
        checkpoint=checkpoint,
    )
    assert pipe[0].weight is pipe[4].weight
    x, y = data()
    loss = pipe.train_step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)
    # A second step accumulates on top, the snapshot saving the tied
    # gradient once (before either stage adds to it).
    pipe.train_step(x, y, nn.MSELoss())
    nn.MSELoss()(ref(x), y).backward()
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("balance", [[5], [2, 3]])
def test_forward_backward_gradients_accumulate(checkpoint: str, balance: list[int]) -> None:
    model = tied_model()
    ref = copy.deepcopy(model)
    pipe = Pipe(
        model, chunks=3, balance=balance, devices=["cpu"] * len(balance), checkpoint=checkpoint
    )
    x, _ = data()
    out = pipe(x)
    expected = ref(x)
    torch.testing.assert_close(out, expected)
    out.pow(3).sum().backward()
    expected.pow(3).sum().backward()
    assert_same_grads(pipe, ref)


def test_failed_step_restores_the_tied_gradient() -> None:
    pipe = Pipe(tied_model(), split_size=2, balance=[2, 3], devices=["cpu"] * 2, schedule="1f1b")
    x, y = data()
    pipe.train_step(x, y, nn.MSELoss())
    before = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    calls = 0

    def failing(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 4:  # after 1F1B has run backwards that touched the tied weight
            raise RuntimeError("boom")
        return nn.functional.mse_loss(out, target)

    with pytest.raises(RuntimeError, match="boom"):
        pipe.train_step(x, y, failing)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, before[name], msg=name)


def test_state_dict_keys_match_the_plain_model() -> None:
    model = tied_model()
    keys = list(model.state_dict())
    assert list(Pipe(model, balance=[2, 3], devices=["cpu"] * 2).state_dict()) == keys

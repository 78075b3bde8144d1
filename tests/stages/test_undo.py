"""A pipe's model put back when its build fails (mpstream.stages.undo):
the parameters and buffers it had, where and as it had them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.stages.undo import undone_on_error


def test_a_failed_block_puts_back_the_tensors_a_move_replaced() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    weight, mean = model[0].weight, model[1].running_mean
    before = [t.clone() for t in (weight, mean)]
    with pytest.raises(RuntimeError, match="a schedule that cannot run"), undone_on_error(model):
        model.double()  # as a move: each parameter's data, each buffer replaced
        assert model[0].weight.dtype == torch.float64
        raise RuntimeError("a schedule that cannot run")
    assert model[0].weight is weight and model[1].running_mean is mean
    assert weight.dtype == mean.dtype == torch.float32
    torch.testing.assert_close([weight, mean], before, rtol=0, atol=0)
    with undone_on_error(model):  # no error: what the block did stays
        model.double()
    assert model[0].weight.dtype == torch.float64


def test_a_failed_block_puts_back_the_gradients_a_move_replaced() -> None:
    # A move converts .grad with its parameter: left moved, the gradient
    # would sit on another device than the parameter put back.
    model = nn.Linear(3, 4)
    model(torch.ones(2, 3)).sum().backward()
    grad = model.weight.grad
    assert grad is not None
    before = grad.clone()
    with pytest.raises(RuntimeError, match="a schedule that cannot run"), undone_on_error(model):
        model.double()
        raise RuntimeError("a schedule that cannot run")
    assert model.weight.grad is grad and grad.dtype == torch.float32
    torch.testing.assert_close(grad, before, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pipe_its_schedule_refuses_leaves_the_model_on_its_device() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="zbv"):
        Pipe(model, balance=[1, 1, 1], devices=["cuda:0"] * 3, schedule="zbv")
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"cpu"}

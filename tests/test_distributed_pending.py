"""mpstream.distributed.pending: ``train_step`` after a ``ddp(x)`` forward
whose backward never ran (a validation pass without ``torch.no_grad()``)
is refused with what to do, before DDP's armed reducer takes its
gradients; the forwards that leave the reducer idle are not refused."""

from __future__ import annotations

import contextlib
import copy
import pickle
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream import distributed as mpdist
from tests.ddp_group import BALANCE, SPLIT, batches, initial_model, one_process_group


@pytest.fixture
def ddp() -> Iterator[torch.nn.parallel.DistributedDataParallel]:
    with one_process_group():
        pipe = Pipe(initial_model(), split_size=SPLIT, balance=BALANCE, devices=["cpu", "cpu"])
        wrapped = mpdist.wrap(pipe)
        yield wrapped
        del wrapped  # its reducer before the group (see docs/ddp.md)


def _validation(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    ddp.eval()
    ddp(x)  # with gradients on: DDP's reducer now waits for a backward
    ddp.train()


def _input_gradient(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    # An adversarial example's direction: autograd.grad runs no parameter's
    # accumulator, so DDP's reducer hooks never fire and it stays armed.
    x = x.clone().requires_grad_()
    torch.autograd.grad(nn.MSELoss()(ddp(x), y), x)


@pytest.mark.parametrize("no_sync", [False, True])
@pytest.mark.parametrize("forward", [_validation, _input_gradient])
def test_train_step_after_a_forward_without_its_backward_is_refused_with_what_to_do(
    ddp: torch.nn.parallel.DistributedDataParallel,
    no_sync: bool,
    forward: Callable[[nn.Module, torch.Tensor, torch.Tensor], None],
) -> None:
    x, y = batches(1)[0]
    forward(ddp, x, y)
    with ddp.no_sync() if no_sync else contextlib.nullcontext():
        with pytest.raises(RuntimeError, match="its backward has not") as refused:
            mpdist.train_step(ddp, x, y, nn.MSELoss())
    assert "torch.no_grad()" in str(refused.value) and "ddp.module(x)" in str(refused.value)
    assert all(p.grad is None for p in ddp.parameters())  # nothing reached the reducer
    # The way out the message gives: a step through DDP's forward starts it afresh.
    nn.MSELoss()(ddp(x), y).backward()
    ddp.zero_grad()
    mpdist.train_step(ddp, x, y, nn.MSELoss())
    assert all(p.grad is not None for p in ddp.parameters())


def _under_no_grad(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    with torch.no_grad():
        ddp(x)


def _inside_no_sync(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    with ddp.no_sync():  # type: ignore[operator]
        ddp(x)


def _with_its_backward(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    nn.MSELoss()(ddp(x), y).backward()
    ddp.zero_grad()


def _input_gradient_through_the_module(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    x = x.clone().requires_grad_()
    torch.autograd.grad(nn.MSELoss()(ddp.module(x), y), x)  # type: ignore[operator]


@pytest.mark.parametrize(
    "forward",
    [_under_no_grad, _inside_no_sync, _with_its_backward, _input_gradient_through_the_module],
)
def test_forwards_that_leave_the_reducer_idle_do_not_refuse_the_next_step(
    ddp: torch.nn.parallel.DistributedDataParallel,
    forward: Callable[[nn.Module, torch.Tensor, torch.Tensor], None],
) -> None:
    x, y = batches(1)[0]
    forward(ddp, x, y)
    ref = Pipe(initial_model(), split_size=SPLIT, balance=BALANCE, devices=["cpu", "cpu"])
    mpdist.train_step(ddp, x, y, nn.MSELoss())
    ref.train_step(x, y, nn.MSELoss())
    for (name, p), q in zip(ddp.module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_an_input_gradient_through_a_static_graph_s_first_forward_does_not_refuse() -> None:
    # Its backward ends with DDP's delayed reduction of every parameter,
    # autograd.grad's too: the reducer is idle after it.
    with one_process_group():
        pipe = Pipe(initial_model(), split_size=SPLIT, balance=BALANCE, devices=["cpu", "cpu"])
        ddp = mpdist.wrap(pipe, static_graph=True)
        x, y = batches(1)[0]
        _input_gradient(ddp, x, y)
        mpdist.train_step(ddp, x, y, nn.MSELoss())
        assert all(p.grad is not None for p in ddp.parameters())
        del ddp  # its reducer before the group


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_an_armed_module_has_an_idle_reducer_and_trains(
    ddp: torch.nn.parallel.DistributedDataParallel, how: str
) -> None:
    # DDP rebuilds its reducer, idle, in a copy: the original's note that a
    # forward awaits its backward must not travel with it.
    x, y = batches(1)[0]
    _validation(ddp, x, y)
    copied = copy.deepcopy(ddp) if how == "deepcopy" else pickle.loads(pickle.dumps(ddp))
    mpdist.train_step(copied, x, y, nn.MSELoss())
    assert all(p.grad is not None for p in copied.parameters())
    with pytest.raises(RuntimeError, match="its backward has not"):
        mpdist.train_step(ddp, x, y, nn.MSELoss())  # the original is still armed
    _validation(copied, x, y)  # the copy's forwards are noted too
    with pytest.raises(RuntimeError, match="its backward has not"):
        mpdist.train_step(copied, x, y, nn.MSELoss())
    del copied  # its reducer before the group

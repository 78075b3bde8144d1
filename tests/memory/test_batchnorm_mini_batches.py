"""Where a mini-batch of a deferred BatchNorm begins and ends
(mpstream.memory.batchnorm): a layer a forward skipped for some
micro-batches updates from those it ran on, one called twice in a forward
says its calls are pooled, and sums left after a call are not the next
one's."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from mpstream import Pipe
from tests.memory.test_batchnorm import assert_same_stats, running_stats


def _deferred(model: nn.Module, chunks: int = 2, balance: tuple[int, int] = (2, 1)) -> Pipe:
    """``model`` in two stages on the CPU, its BatchNorms deferred."""
    return Pipe(model, chunks=chunks, balance=list(balance), devices=["cpu", "cpu"],
                deferred_batch_norm=True)  # fmt: skip


def _run(pipe: Pipe, x: torch.Tensor, y: torch.Tensor, step: bool) -> None:
    """A training step of ``pipe`` on ``x`` towards ``y`` (``step``), else a call on ``x``."""
    if step:
        pipe.train_step(x, y, nn.MSELoss())
    else:
        pipe(x)


class _Sometimes(nn.Module):
    """A BatchNorm that a micro-batch of 3 or fewer samples skips."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4, momentum=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x) if x.shape[0] > 3 else x


@pytest.mark.parametrize("step", [False, True])
def test_a_norm_skipped_for_some_micro_batches_updates_from_those_it_ran_on(step: bool) -> None:
    # Batch 10 in 3 micro-batches (4, 4, 2): the norm sees the first two.
    # Each mini-batch updates once from what it saw, none carries into the next.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Sometimes(), nn.Linear(4, 2)).double()
    ref = copy.deepcopy(model)
    pipe = _deferred(model, chunks=3)
    for calls in (1, 2, 3):
        x, y = torch.randn(10, 4, dtype=torch.float64), torch.randn(10, 2, dtype=torch.float64)
        _run(pipe, x, y, step)
        with torch.no_grad():
            ref[1].bn(ref[0](x[:8]))  # the samples the pipe's norm saw, at once
        norm = pipe[1].bn
        assert int(norm.num_batches_tracked) == calls and norm.tracked == 0
        torch.testing.assert_close(norm.running_mean, ref[1].bn.running_mean)
        torch.testing.assert_close(norm.running_var, ref[1].bn.running_var)


class _Twice(nn.Module):
    """One BatchNorm called twice in a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4, momentum=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(torch.tanh(self.lin(self.bn(x))))


@pytest.mark.parametrize("step", [False, True])
def test_a_norm_called_twice_in_a_forward_says_it_pools_its_calls(step: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Twice(), nn.Linear(4, 2)).double()
    pipe = _deferred(model)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    said = r"ran 4 times in a mini-batch of 2 micro-batches: called more than once"
    with pytest.warns(UserWarning, match=said):
        _run(pipe, x, y, step)
    norm = pipe[1].bn
    assert norm.tracked == 0  # nothing left for the next mini-batch
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        _run(pipe, x, y, step)


def test_a_norm_called_twice_counts_each_call_in_pipe_x_and_train_step() -> None:
    # train_step updated once after the first micro-batches' calls and once
    # after the rest, pipe(x) once from all: both now update from all the
    # calls pooled, once per call, as often as the plain model's layer.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Twice(), nn.Linear(4, 2)).double()
    plain, micro = copy.deepcopy(model), copy.deepcopy(model)
    seen: list[torch.Tensor] = []  # the inputs of the pipe's calls
    micro[1].bn.register_forward_pre_hook(lambda _, a: seen.append(a[0].detach()))
    called, stepped = (_deferred(copy.deepcopy(model)) for _ in range(2))
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        called(x)
        stepped.train_step(x, y, nn.MSELoss())
    with torch.no_grad():
        plain(x)
        for part in x.chunk(2):
            micro(part)  # normalises each micro-batch as the pipe does
    pooled = torch.cat(seen)
    tracked = int(plain[1].bn.num_batches_tracked)
    assert tracked == 2
    for pipe in (called, stepped):
        norm = pipe[1].bn
        assert int(norm.num_batches_tracked) == tracked
        # momentum=None: a cumulative average of the pooled statistics.
        torch.testing.assert_close(norm.running_mean, pooled.mean(0))
        torch.testing.assert_close(norm.running_var, pooled.var(0))


@pytest.mark.parametrize("step", [False, True])
def test_the_pooled_warning_raised_as_an_error_updates_no_norm(step: bool) -> None:
    # Under -W error the warning of the middle norm raised between the
    # norms' updates: the first had updated, the others kept their sums.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 4), nn.BatchNorm1d(4), _Twice(), nn.BatchNorm1d(4), nn.Linear(4, 2)
    ).double()
    pipe, twin = (_deferred(copy.deepcopy(model), balance=(3, 2)) for _ in range(2))
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    before = [b.clone() for b in pipe.buffers()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="called more than once"):
            _run(pipe, x, y, step)
    for a, b in zip(pipe.buffers(), before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(n.tracked == 0 for n in pipe.modules() if isinstance(n, nn.BatchNorm1d))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _run(pipe, x, y, step)  # as if the failed call had not happened
        _run(twin, x, y, step)
    for a, b in zip(pipe.buffers(), twin.buffers()):
        torch.testing.assert_close(a, b)


def test_sums_left_after_a_call_are_not_part_of_the_next() -> None:
    # A recompute outside mpstream's checkpointing (here: a forward run by
    # hand) adds to the sums after the call has committed.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    ref = copy.deepcopy(model)
    pipe = _deferred(model)
    x = torch.randn(8, 3, dtype=torch.float64)
    pipe(x)
    ref(x)
    with torch.no_grad():
        pipe[1](torch.randn(4, 4, dtype=torch.float64))  # stray: 1 of the 2 expected
    assert pipe[1].tracked == 1
    x = torch.randn(8, 3, dtype=torch.float64)
    pipe(x)
    ref(x)
    assert_same_stats(pipe, running_stats(ref))

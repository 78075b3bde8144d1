"""A norm whose running statistics two stages would write
(mpstream.memory.shared_writes): each stage runs on its own stream, so two
stages' forwards of different micro-batches overlap on a device, and a norm
reached from both would be updated from two streams at once (on a GPU a
race: statistics wrong without an error). Such a training-mode run is
refused by name before anything changes; in eval mode, where nothing is
written, it runs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

from mpstream import Pipe
from mpstream.memory.checkpoint import graph_writes
from tests.helpers import assert_same_grads


class _AroundSplit(nn.Module):
    """One BatchNorm called before and after the split point ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.b(self.bn(self.a(x))))


class _Block(nn.Module):
    """A layer and a norm it is given (two blocks may share one)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 4), torch.randn(8, 4)


def _split(deferred: bool, tracer: str = "fx") -> Pipe:
    torch.manual_seed(0)
    return Pipe(_AroundSplit(), chunks=2, split_points=["b"], devices=["cpu", "cpu"],
                deferred_batch_norm=deferred, tracer=tracer, sample=torch.randn(4, 4))  # fmt: skip


@pytest.mark.parametrize("step", [False, True])
@pytest.mark.parametrize("deferred", [False, True])
def test_a_norm_two_stages_call_is_refused_in_training(deferred: bool, step: bool) -> None:
    pipe = _split(deferred)
    x, y = _batch()
    before = copy.deepcopy(pipe.state_dict())
    said = r"'bn' .* stages 0 and 1, .* at once"
    with pytest.raises(ValueError, match=said):
        if step:
            pipe.train_step(x, y, nn.MSELoss())
        else:
            pipe(x)
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(value, before[name], msg=name)  # nothing updated
    assert all(p.grad is None for p in pipe.parameters())
    if deferred:
        assert pipe.bn.tracked == 0 and float(pipe.bn.count) == 0.0  # nothing accumulated


def test_a_norm_two_stages_call_runs_in_eval_mode() -> None:
    pipe = _split(deferred=False)
    plain = copy.deepcopy(_AroundSplit()).eval()
    plain.load_state_dict(pipe.state_dict())
    pipe.eval()
    x, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), plain(x))


def test_an_exported_stage_pair_writing_one_norm_is_refused() -> None:
    # torch.export makes BatchNorm an operator on the stages' own buffers:
    # both stages' graphs write running_mean and running_var.
    pipe = _split(deferred=False, tracer="export")
    x, y = _batch()
    with pytest.raises(ValueError, match=r"'bn\.running_mean' .* stages 0 and 1"):
        pipe.train_step(x, y, nn.MSELoss())
    assert int(pipe.bn.num_batches_tracked) == 0


def test_blocks_of_two_stages_holding_one_norm() -> None:
    # A plain norm held by a block of each stage: refused. Deferred, each
    # block gets a layer of its own over the shared statistics, which
    # accumulates apart and updates after the run: it trains.
    torch.manual_seed(0)
    shared = nn.BatchNorm1d(4)
    model = nn.Sequential(_Block(shared), _Block(shared))
    x, y = _batch()
    plain = Pipe(copy.deepcopy(model), chunks=2, balance=[1, 1], devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match=r"'0\.bn' .* stages 0 and 1"):
        plain.train_step(x, y, nn.MSELoss())
    deferred = Pipe(model, chunks=2, balance=[1, 1], devices=["cpu", "cpu"],
                    deferred_batch_norm=True)  # fmt: skip
    deferred.train_step(x, y, nn.MSELoss())
    assert int(deferred[0].bn.num_batches_tracked) == 2  # one update per block


def test_a_norm_whose_tracking_is_switched_is_judged_as_it_is_now() -> None:
    # track_running_stats is read at each run, as the norm's forward reads
    # it: switched off after a refusal (as the error suggests) the pipe runs
    # as the plain model (batch statistics per micro-batch of 4 rows);
    # switched on later, it is refused again. Nothing registers a module in
    # between (which would make the pipe walk its stages anew).
    pipe = _split(deferred=False)
    plain = _AroundSplit()
    plain.load_state_dict(pipe.state_dict())
    x, y = _batch()
    with pytest.raises(ValueError, match=r"'bn' .* stages 0 and 1"):
        pipe(x)
    pipe.bn.track_running_stats = plain.bn.track_running_stats = False
    torch.testing.assert_close(pipe(x), torch.cat([plain(x[:4]), plain(x[4:])]))
    assert int(pipe.bn.num_batches_tracked) == 0
    pipe.bn.track_running_stats = True
    with pytest.raises(ValueError, match=r"'bn' .* stages 0 and 1"):
        pipe.train_step(x, y, nn.MSELoss())
    assert int(pipe.bn.num_batches_tracked) == 0


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_frozen_norm_two_stages_run_trains_as_the_plain_model(tracer: str) -> None:
    # The norm alone in eval mode (frozen statistics) in a training pipe:
    # exported, its stages' batch_norm reads running_mean and running_var
    # without writing them (training=False), so nothing races; it was
    # refused by the statistics' argument names alone.
    pipe = _split(deferred=False, tracer=tracer)
    plain = _AroundSplit()
    plain.load_state_dict(pipe.state_dict())
    pipe.bn.eval()
    plain.bn.eval()
    before = copy.deepcopy(pipe.bn.state_dict())
    x, y = _batch()
    loss = pipe.train_step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(plain(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    assert_same_grads(pipe, plain)
    for name, value in pipe.bn.state_dict().items():
        torch.testing.assert_close(value, before[name], msg=name)  # nothing written
    for part in pipe.partitions:  # read, not written: whatever module's flag is read
        for gm in (m for m in part.modules() if isinstance(m, fx.GraphModule)):
            assert graph_writes(gm, statistics=True) == []


def test_an_exported_norm_in_training_mode_inside_an_eval_pipe_is_refused() -> None:
    # pipe.eval() then the norm alone in training mode: exported as such,
    # both stages' batch_norm write its statistics. The stages' graph
    # modules were in eval mode, and their flag was the one read: both
    # stages wrote (num_batches_tracked 4 after one call of 2 micro-batches).
    pipe = _split(deferred=False, tracer="export")
    pipe.eval()
    pipe.bn.train()
    x, _ = _batch()
    with pytest.raises(ValueError, match=r"'bn\.running_mean' .* stages 0 and 1"), torch.no_grad():
        pipe(x)
    assert int(pipe.bn.num_batches_tracked) == 0

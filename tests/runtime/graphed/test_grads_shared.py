"""Gradients of a parameter that more than one gradient store holds: the
splits of a traced pipe's two kinds of call, each with its own stores, and
a weight tied after the first capture (replays emulated on the CPU, see
test_stages.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated
from mpstream.runtime.graphed.grads import GradStore
from tests.helpers import mlp


class Masked(nn.Module):
    """Two kinds of call: with a mask and without (two traced splits)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        h = self.a(x)
        if mask is not None:
            h = h * mask
        return self.b(h)  # type: ignore[no-any-return]


def test_two_kinds_of_call_interleaved_in_one_backward_add_every_gradient() -> None:
    # The second kind's stores take .grad over from the first's within the
    # pass; the first kind's next replay must add into .grad, not into its
    # own view that .grad no longer is.
    model = Masked().double()
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu", "cpu"], chunks=2,
        graphs=Emulated(),
    )  # fmt: skip
    x, x2, mask = (torch.randn(4, 4, dtype=torch.float64) for _ in range(3))
    for _ in range(2):  # the second pass replays
        for m in (model, pipe):
            m.zero_grad()
            outs = [m(x), m(x, mask), m(x2)]  # later calls' backwards run first
            sum(y.square().sum() for y in outs).backward()
        for (name, p), q in zip(pipe.named_parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)


def _three_stages(model: nn.Sequential) -> tuple[Pipe, Tensor, Tensor]:
    """A pipe of a copy of ``model`` (``mlp([5, 5, 5, 5])``) in three stages
    of two layers, replays emulated, and a batch of 7 rows with its targets."""
    pipe = Pipe(
        copy.deepcopy(model), chunks=3, balance=[2, 2, 2], devices=["cpu"] * 3,
        graphs=Emulated(),
    )  # fmt: skip
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)
    return pipe, x, y


def _tied_after_capture() -> tuple[nn.Sequential, Pipe, Tensor, Tensor]:
    """A model and its :func:`_three_stages` pipe, each run forward and
    backward once (the pipe captures), then layer 4's weight tied to layer
    0's: stage 0's store holds it as its own, stage 2's new store in a side
    buffer."""
    model = mlp([5, 5, 5, 5])
    pipe, x, y = _three_stages(model)
    for m in (model, pipe):
        nn.functional.mse_loss(m(x), y).backward()  # captures
        m[4].weight = m[0].weight
    return model, pipe, x, y


def test_a_weight_tied_after_the_first_capture_is_added_after_every_stage_s_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Tied after stage 0's store was made: the weight is stage 0's own
    # (.grad is its view, which its graphs add into on its stream) and in a
    # side buffer of stage 2's new store. Stage 2's flush, autograd's first
    # final callback, must not add its side buffer into .grad before stage
    # 0's flush has ordered the caller's stream after stage 0's graphs: on
    # a GPU the two adds would race. No flush may change that .grad.
    model, pipe, x, y = _tied_after_capture()
    changed: list[bool] = []
    flush = GradStore.flush

    def watched(store: GradStore, autograd: bool = True) -> None:
        g = pipe[0].weight.grad
        before = None if g is None else g.clone()
        flush(store, autograd)
        g = pipe[0].weight.grad
        changed.append(before is None or g is None or not torch.equal(g, before))

    monkeypatch.setattr(GradStore, "flush", watched)
    for _ in range(2):  # the second pass replays stage 2's new graphs
        for m in (model, pipe):
            nn.functional.mse_loss(m(x), y).backward()
        for (name, p), q in zip(pipe.named_parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert changed and not any(changed)


def test_a_hook_raising_in_the_last_flush_leaves_later_tied_gradients_whole() -> None:
    # The tied weight's side buffer waits for a final callback queued behind
    # every store's flush; a hook raising in the last flush drops it, and
    # the next pass must queue its own.
    model = mlp([5, 5, 5, 5])
    model[4].weight = model[0].weight
    pipe, x, y = _three_stages(model)
    nn.functional.mse_loss(pipe(x), y).backward()  # captures
    failing = [True]

    def hook(p: Tensor) -> None:
        if failing.pop() if failing else False:
            raise RuntimeError("hook failed")

    pipe[0].bias.register_post_accumulate_grad_hook(hook)  # stage 0's: the last flush
    with pytest.raises(RuntimeError, match="hook failed"):
        nn.functional.mse_loss(pipe(x), y).backward()
    for m in (model, pipe):
        m.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
    for (name, p), q in zip(pipe.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("train_step", [False, True])
def test_a_weight_tied_after_the_first_capture_runs_its_hook_once_per_pass(
    train_step: bool,
) -> None:
    # Stage 0's store holds the weight as its own, stage 2's new store in a
    # side buffer: its hook runs once, with the whole gradient, as when the
    # weights were tied from the start (not also after stage 0's adds).
    model, pipe, x, y = _tied_after_capture()
    seen: list[Tensor] = []
    pipe[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    for _ in range(2):  # the second pass replays stage 2's new graphs
        seen.clear()
        for m in (model, pipe):
            m.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if train_step:
            pipe.train_step(x, y, nn.MSELoss())
        else:
            nn.functional.mse_loss(pipe(x), y).backward()
        assert len(seen) == 1
        torch.testing.assert_close(seen[0], model[0].weight.grad)

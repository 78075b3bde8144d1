"""During ``train_step`` a graphed stage's parameter gradients are summed per
stage and handed to ``.grad`` once: the eager pipe's gradients, accumulated
once per step instead of once per micro-batch; a failed step leaves no
partial sums; outside ``train_step`` replays return their gradients."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime.graphed import GraphedCall
from mpstream.runtime.graphed.grads import StageGrads
from tests.helpers import assert_same_grads, mlp
from tests.runtime.graphed.test_stages import WIDTHS, data, pair


def count_accumulations(pipe: Pipe) -> Counter[str]:
    """How often each parameter's post-accumulate-grad hook runs (autograd
    runs it also where no gradient arrived: counted as ``name?``)."""
    seen: Counter[str] = Counter()
    for name, p in pipe.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: seen.update([name if p.grad is not None else f"{name}?"])
        )
    return seen


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_train_step_hands_each_stage_s_sums_over_once(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager, graphed = pair(mlp(WIDTHS), chunks=4, schedule=schedule)
    returned, flushed = [], []
    copy_out = GraphedCall._param_grads
    flush = StageGrads.flush

    def spy_copy(call: GraphedCall) -> list[Tensor | None]:
        returned.append(call)
        return copy_out(call)

    def spy_flush(sums: StageGrads) -> None:
        flushed.append(len(sums._sums))
        flush(sums)

    monkeypatch.setattr(GraphedCall, "_param_grads", spy_copy)
    monkeypatch.setattr(StageGrads, "flush", spy_flush)
    x, y = data()
    for _ in range(2):  # no zero_grad: the second step adds to .grad
        losses = [pipe.train_step(x, y, nn.MSELoss()) for pipe in (eager, graphed)]
        torch.testing.assert_close(losses[1], losses[0])
        assert_same_grads(graphed, eager)
    assert returned == []  # no gradient copied out per replay
    # Each stage's 4 parameters, once per step: step 1 hands the sums over
    # as the gradients, step 2 adds them into those.
    assert flushed == [4, 4] * 2


@pytest.mark.parametrize("schedule", ["gpipe", "zb_h1"])
def test_a_stage_with_a_post_accumulate_hook_keeps_per_micro_batch_accumulation(
    schedule: str,
) -> None:
    # Under zb_h1 a graphed stage's weight pass is its own second half:
    # B must not run the parameters' accumulation (and their hooks) too.
    eager, graphed = pair(mlp(WIDTHS), chunks=4, schedule=schedule)
    counts = [count_accumulations(pipe) for pipe in (eager, graphed)]
    x, y = data()
    for pipe in (eager, graphed):
        pipe.train_step(x, y, nn.MSELoss())
    assert_same_grads(graphed, eager)
    assert counts[1] == counts[0] == Counter({n: 4 for n, _ in eager.named_parameters()})


def test_a_failed_step_leaves_no_partial_sums() -> None:
    eager, graphed = pair(mlp(WIDTHS), chunks=4)
    x, y = data()
    calls = 0

    def failing(out: Tensor, target: Tensor) -> Tensor:
        nonlocal calls
        calls += 1
        if calls == 7:  # the second step's third micro-batch
            raise RuntimeError("loss failed")
        return nn.functional.mse_loss(out, target)

    graphed.train_step(x, y, failing)
    with pytest.raises(RuntimeError, match="loss failed"):
        graphed.train_step(x, y, failing)
    eager.train_step(x, y, nn.MSELoss())
    assert_same_grads(graphed, eager)  # as after one step: the failed one left nothing
    for pipe in (eager, graphed):
        pipe.train_step(x, y, nn.MSELoss())
    assert_same_grads(graphed, eager)


def test_outside_train_step_replays_return_their_gradients() -> None:
    eager, graphed = pair(mlp(WIDTHS), chunks=2)
    x, y = data()
    for pipe in (eager, graphed):
        pipe.train_step(x, y, nn.MSELoss())
    got = []
    for pipe in (eager, graphed):
        loss = nn.functional.mse_loss(pipe(x), y)
        got.append(torch.autograd.grad(loss, list(pipe.parameters())))
    for a, b in zip(*got):
        torch.testing.assert_close(b, a)


def test_a_weight_two_stages_share_sums_per_stage() -> None:
    # Tied: the first and the last layer share a weight, on stages 0 and 2.
    model = mlp([5, 5, 5, 5])
    model[4].weight = model[0].weight
    eager, graphed = pair(model, chunks=3, balance=[2, 2, 2], devices=["cpu"] * 3)
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)
    for _ in range(2):  # the second step adds to the gradients of the first
        for pipe in (eager, graphed):
            pipe.train_step(x, y, nn.MSELoss())
        assert_same_grads(graphed, eager)


def test_the_users_own_loop_hands_the_sums_over_once_per_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    eager, graphed = pair(mlp(WIDTHS), chunks=4)
    returned: list[GraphedCall] = []
    copy_out = GraphedCall._param_grads

    def spy(call: GraphedCall) -> list[Tensor | None]:
        returned.append(call)
        return copy_out(call)

    monkeypatch.setattr(GraphedCall, "_param_grads", spy)
    x, y = data()
    for _ in range(2):  # no zero_grad: the second backward adds to .grad
        for pipe in (eager, graphed):
            nn.functional.mse_loss(pipe(x), y).backward()
        assert_same_grads(graphed, eager)
    assert returned == []


def fail_a_backward(pipe: Pipe, x: Tensor, y: Tensor) -> None:
    """A backward through ``pipe`` that raises once its stages' replays have
    run (in a hook on the input's gradient), then ``zero_grad``."""
    inp = x.clone().requires_grad_()
    inp.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("hook failed")))
    with pytest.raises(RuntimeError, match="hook failed"):
        nn.functional.mse_loss(pipe(inp), y).backward()
    pipe.zero_grad(set_to_none=True)


@pytest.mark.parametrize("then", ["backward", "train_step"])
def test_a_failed_backward_in_the_users_loop_leaves_no_sums_behind(then: str) -> None:
    eager, graphed = pair(mlp(WIDTHS), chunks=4)
    x, y = data()
    for pipe in (eager, graphed):
        fail_a_backward(pipe, x, y)
        if then == "train_step":
            pipe.train_step(x, y, nn.MSELoss())
        else:
            nn.functional.mse_loss(pipe(x), y).backward()
    assert_same_grads(graphed, eager)


def test_a_backward_inside_a_backward_keeps_the_outer_pass_s_sums() -> None:
    eager, graphed = pair(mlp(WIDTHS), chunks=2)
    x, y = data()
    x2, y2 = data()
    for pipe in (eager, graphed):

        class Nested(torch.autograd.Function):
            """Runs another backward through the same pipe from its own."""

            @staticmethod
            def forward(ctx: object, t: Tensor) -> Tensor:  # type: ignore[override]
                return t.clone()

            @staticmethod
            def backward(ctx: object, g: Tensor) -> Tensor:  # type: ignore[override]
                with torch.enable_grad():
                    nn.functional.mse_loss(pipe(x2), y2).backward()  # noqa: B023
                return g

        out = pipe(Nested.apply(x.clone().requires_grad_()))
        nn.functional.mse_loss(out, y).backward()
    assert_same_grads(graphed, eager)


class Branch(nn.Module):
    """Block 0's value reaches stage 1, which drops it with block 1's."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        self.blocks[1](self.blocks[0](x))
        return self.blocks[2](x)  # type: ignore[no-any-return]


def check_reached(model: nn.Module, split: str, schedule: str, reached: list[str]) -> None:
    """After a backward and a ``train_step``, eager and graphed pipes give
    gradients to ``reached`` only, and equal ones."""
    eager, graphed = pair(
        model.double(), chunks=2, schedule=schedule, balance=None, split_points=[split]
    )
    x, y = torch.randn(4, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    for pipe in (eager, graphed):
        pipe(x).sum().backward()
        pipe.train_step(x, y, nn.MSELoss())
    for pipe in (eager, graphed):
        assert [n for n, p in pipe.named_parameters() if p.grad is not None] == reached
    for name in reached:
        torch.testing.assert_close(graphed.get_parameter(name).grad, eager.get_parameter(name).grad)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_a_call_no_gradient_reaches_leaves_its_parameters_without_one(schedule: str) -> None:
    # A replayed backward would hand them zeros where eager autograd gives None.
    check_reached(Branch(), "blocks.1", schedule, ["blocks.2.weight", "blocks.2.bias"])


class TwoOut(nn.Module):
    """Stage 0 returns blocks 0's and 1's values; stage 1 drops block 0's."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.blocks[0](x), self.blocks[1](x)
        self.blocks[2](a)
        return self.blocks[3](b)  # type: ignore[no-any-return]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_what_only_an_output_without_gradient_reaches_gets_none(schedule: str) -> None:
    reached = ["blocks.1.weight", "blocks.1.bias", "blocks.3.weight", "blocks.3.bias"]
    check_reached(TwoOut(), "blocks.2", schedule, reached)

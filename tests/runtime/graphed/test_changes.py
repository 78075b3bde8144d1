"""Graphed stages after the user changed something between runs or tasks:
a failed step after a stage's parameters changed puts every gradient
back, buffers a graphed stage hands on stay what autograd saved, and a
hook that takes ``.grad`` away between a split backward's B and W leaves
W's gradient to the next hook, and a parameter frozen between a replayed
forward and its backward is named (replays emulated on the CPU, see
test_stages.py)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated, GraphedCall, GraphWarning
from tests.helpers import assert_same_grads, mlp
from tests.runtime.graphed.pairs import WIDTHS, data, pair


def replace_weight(pipe: Pipe) -> None:
    pipe[4].weight = nn.Parameter(pipe[4].weight.detach().clone())


def unfreeze_bias(pipe: Pipe) -> None:
    pipe[4].bias.requires_grad_(True)  # frozen for the first step


@pytest.mark.parametrize("change", [replace_weight, unfreeze_bias])
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_a_failed_step_after_a_stage_changed_puts_every_gradient_back(
    change: Callable[[Pipe], None], schedule: str
) -> None:
    # The stage's gradient buffers are made anew in the step; a parameter
    # the old ones did not hold must not keep what the failed step added.
    eager, graphed = pair(mlp(WIDTHS), chunks=3, schedule=schedule)
    x, y = data()
    calls = 0

    def failing(out: Tensor, target: Tensor) -> Tensor:
        nonlocal calls
        calls += 1
        if calls == 3:  # after the first micro-batches' backwards (1F1B)
            raise RuntimeError("loss failed")
        return nn.functional.mse_loss(out, target)

    for pipe in (eager, graphed):
        pipe[4].bias.requires_grad_(change is not unfreeze_bias)
        pipe.train_step(x, y, nn.MSELoss())
        change(pipe)
    before = [None if p.grad is None else p.grad.clone() for p in graphed.parameters()]
    with pytest.raises(RuntimeError, match="loss failed"):
        graphed.train_step(x, y, failing)
    for p, b in zip(graphed.parameters(), before):
        assert (p.grad is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(p.grad, b)
    for pipe in (eager, graphed):
        pipe.train_step(x, y, nn.MSELoss())
    assert_same_grads(graphed, eager)


def test_a_frozen_stage_s_outputs_saved_by_an_eager_stage_outlive_its_next_replay() -> None:
    # Stage 0 is frozen: no autograd node keeps its call busy. Stage 1 runs
    # eagerly (a tensor hook) and saves stage 0's output for its backward,
    # which runs after a second forward replayed stage 0 again.
    model = mlp(WIDTHS)
    for p in model[:4].parameters():
        p.requires_grad_(False)
    eager, graphed = pair(model, chunks=2)
    for pipe in (eager, graphed):
        pipe[4].weight.register_hook(lambda g: g)
    x, y = data()
    with pytest.warns(UserWarning, match="tensor hook"):
        for pipe in (eager, graphed):
            first = nn.functional.mse_loss(pipe(x), y)
            second = nn.functional.mse_loss(pipe(2 * x), y)
            (first + second).backward()
    for (name, a), (_, b) in zip(graphed.named_parameters(), eager.named_parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_a_hook_taking_grad_away_before_a_deferred_weight_pass_sees_its_gradient() -> None:
    # zb_h1 runs stage 1's B of micro-batch 2 before the W of micro-batch 1,
    # whose hook takes .grad away: W of micro-batch 2 must add into .grad
    # again, not into the buffer the hook detached.
    eager, graphed = pair(mlp(WIDTHS), chunks=3, schedule="zb_h1")
    x, y = data()
    seen: dict[Pipe, list[Tensor | None]] = {}
    for pipe in (eager, graphed):
        got = seen[pipe] = []

        def hook(p: Tensor, got: list[Tensor | None] = got) -> None:
            got.append(None if p.grad is None else p.grad.clone())
            p.grad = None  # an optimizer in backward

        pipe[6].weight.register_post_accumulate_grad_hook(hook)
        pipe.train_step(x, y, nn.MSELoss())
    assert len(seen[graphed]) == len(seen[eager]) == 3
    for a, b in zip(seen[graphed], seen[eager]):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b)


def test_a_failed_step_after_weights_were_tied_puts_the_tied_gradient_back() -> None:
    # Tied after the first step: both stages' buffers are made anew in the
    # failing step, with the tied weight in side buffers that the step's
    # end adds into .grad before the gradients are put back.
    eager, graphed = pair(
        mlp([5, 5, 5, 5]), chunks=3, balance=[2, 2, 2], devices=["cpu"] * 3, schedule="1f1b"
    )
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)
    calls = 0

    def failing(out: Tensor, target: Tensor) -> Tensor:
        nonlocal calls
        calls += 1
        if calls == 3:  # after the first micro-batches' backwards
            raise RuntimeError("loss failed")
        return nn.functional.mse_loss(out, target)

    for pipe in (eager, graphed):
        pipe.train_step(x, y, nn.MSELoss())
        shared = nn.Parameter(pipe[0].weight.detach().clone())
        pipe[0].weight, pipe[4].weight = shared, shared
    before = [None if p.grad is None else p.grad.clone() for p in graphed.parameters()]
    with pytest.raises(RuntimeError, match="loss failed"):
        graphed.train_step(x, y, failing)
    for p, b in zip(graphed.parameters(), before):  # the tied weight's: None
        assert (p.grad is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(p.grad, b)
    for pipe in (eager, graphed):
        pipe.train_step(x, y, nn.MSELoss())
    assert_same_grads(graphed, eager)


def test_a_failed_step_whose_recapture_failed_puts_an_eager_gradient_back() -> None:
    # The stage changed, so its buffers are made anew in the step; then its
    # capture fails and it runs eagerly: autograd accumulates into the new
    # weight's .grad (set by hand) in place, which a failure must undo.
    backend = Emulated()
    real = backend.capture
    _, graphed = pair(mlp(WIDTHS), graphs=backend, chunks=3, schedule="1f1b")
    x, y = data()
    graphed.train_step(x, y, nn.MSELoss())
    weight = nn.Parameter(graphed[4].weight.detach().clone())
    weight.grad = torch.ones_like(weight)
    graphed[4].weight = weight

    def refuse(call: GraphedCall, fn: Callable[..., Any]) -> None:
        if fn is graphed.partitions[1]:
            raise RuntimeError("operation not permitted when stream is capturing")
        real(call, fn)

    backend.capture = refuse  # type: ignore[method-assign]
    calls = 0

    def failing(out: Tensor, target: Tensor) -> Tensor:
        nonlocal calls
        calls += 1
        if calls == 3:  # after the first micro-batches' backwards
            raise RuntimeError("loss failed")
        return nn.functional.mse_loss(out, target)

    before = [None if p.grad is None else p.grad.clone() for p in graphed.parameters()]
    with pytest.warns(GraphWarning, match="capture failed"):
        with pytest.raises(RuntimeError, match="loss failed"):
            graphed.train_step(x, y, failing)
    for p, b in zip(graphed.parameters(), before):
        assert (p.grad is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(p.grad, b)


@pytest.mark.filterwarnings("ignore::mpstream.SingleMicroBatchWarning")
def test_the_gradient_a_hook_of_the_user_s_input_sees_outlives_the_next_backward() -> None:
    # One micro-batch: the first stage's replay takes the user's leaf as it
    # is, and hands its gradient back a copy, not the call's buffer, which
    # the next backward rewrites.
    model = mlp(WIDTHS)
    pipe = Pipe(model, graphs=Emulated(), balance=[4, 4], devices=["cpu"] * 2, chunks=1)
    seen: list[tuple[Tensor, Tensor]] = []
    for _ in range(3):  # capture, then replays
        x = torch.randn(4, WIDTHS[0], dtype=torch.float64, requires_grad=True)
        x.register_hook(lambda g: seen.append((g, g.clone())))
        (pipe(x) ** 2).sum().backward()
    for g, then in seen:
        torch.testing.assert_close(g, then)


@pytest.mark.parametrize("loop", ["train_step", "own"])
def test_a_parameter_frozen_between_a_replayed_forward_and_its_backward_is_named(
    loop: str,
) -> None:
    # The replayed backward differentiates what the forward saw: eager
    # autograd leaves the frozen one's .grad alone; torch's own error named
    # nothing. The next step, frozen from its start, runs as the eager pipe.
    eager, graphed = pair(mlp(WIDTHS), chunks=2)
    x, y = data()
    for pipe in (eager, graphed):
        pipe.train_step(x, y, nn.functional.mse_loss)  # captured

    def freezing(out: Tensor, target: Tensor) -> Tensor:
        graphed[0].weight.requires_grad_(False)
        return nn.functional.mse_loss(out, target)

    message = "parameter '0.weight' of stage 0 of 2 (layers '0', '1', '2', '3' on cpu) stopped"
    with pytest.raises(RuntimeError, match=re.escape(message)):
        if loop == "train_step":
            graphed.train_step(x, y, freezing)
        else:
            loss = freezing(graphed(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
    eager[0].weight.requires_grad_(False)
    for pipe in (eager, graphed):
        pipe.zero_grad()
        pipe.train_step(x, y, nn.functional.mse_loss)
    for (name, a), (_, b) in zip(graphed.named_parameters(), eager.named_parameters()):
        assert (a.grad is None) == (b.grad is None) == (name == "0.weight"), name
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, msg=name)

"""A graphed stage's gradients and PyTorch's hooks on them: post-accumulate
hooks run as often as eager autograd runs them (once per micro-batch in a
``train_step``, once per pass in the user's loop, once per summed pass for a
weight two stages share), a hook may take ``.grad`` away, ``autograd.grad``
runs none, and a backward pass asks torch once whether it accumulates
(replays emulated on the CPU, see test_stages.py)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime.graphed import GraphWarning
from tests.helpers import assert_same_grads, mlp
from tests.runtime.graphed.pairs import WIDTHS, data, pair
from tests.runtime.graphed.test_grads import RUNS, tied_model, user_loop


def count_accumulations(pipe: Pipe) -> Counter[str]:
    """How often each parameter's post-accumulate-grad hook runs."""
    seen: Counter[str] = Counter()
    for name, p in pipe.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: seen.update([name if p.grad is not None else f"{name}?"])
        )
    return seen


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("schedule", ["gpipe", "zb_h1"])
def test_post_accumulate_hooks_run_once_per_micro_batch(run: str, schedule: str) -> None:
    eager, graphed = pair(mlp(WIDTHS), chunks=4, schedule=schedule)
    counts = [count_accumulations(pipe) for pipe in (eager, graphed)]
    x, y = data()
    for pipe in (eager, graphed):
        RUNS[run](pipe, x, y)
    assert_same_grads(graphed, eager)
    per_pass = 4 if run == "step" else 1  # autograd accumulates a pass once
    assert counts[1] == counts[0] == Counter({n: per_pass for n, _ in eager.named_parameters()})


@pytest.mark.filterwarnings("error::mpstream.runtime.graphed.GraphWarning")  # nothing lost
@pytest.mark.parametrize("run", RUNS)
def test_a_hook_that_takes_grad_away_gets_each_micro_batch_alone(run: str) -> None:
    # An optimizer in backward, or an offload: consume .grad, set it to None.
    eager, graphed = pair(mlp(WIDTHS), chunks=4)
    taken = []
    for pipe in (eager, graphed):
        got: dict[str, list[Tensor | None]] = {}
        for name, p in pipe.named_parameters():

            def take(
                p: Tensor, name: str = name, got: dict[str, list[Tensor | None]] = got
            ) -> None:
                got.setdefault(name, []).append(None if p.grad is None else p.grad.clone())
                p.grad = None

            p.register_post_accumulate_grad_hook(take)
        taken.append(got)
    x, y = data()
    for _ in range(2):
        for pipe in (eager, graphed):
            RUNS[run](pipe, x, y)
    assert taken[1].keys() == taken[0].keys()
    for name, seen in taken[0].items():
        assert len(taken[1][name]) == len(seen) == (8 if run == "step" else 2)
        torch.testing.assert_close(taken[1][name], seen)
    assert all(p.grad is None for p in graphed.parameters())


@pytest.mark.filterwarnings("error::mpstream.runtime.graphed.GraphWarning")  # nothing lost
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_an_optimizer_in_backward_steps_as_eager_and_warns_nothing(schedule: str) -> None:
    # Each parameter's hook steps its own optimizer and takes .grad away:
    # the stores see .grad change (no GraphWarning), and every pass's
    # parameters match the eager pipe's. In the user's loop only: a
    # train_step's hooks run per micro-batch, and a step of the weights
    # there fails the next micro-batch's eager backward (modified in place).
    eager, graphed = pair(mlp(WIDTHS), chunks=4, schedule=schedule)
    for pipe in (eager, graphed):
        for p in pipe.parameters():
            opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)

            def step(p: Tensor, opt: torch.optim.Optimizer = opt) -> None:
                opt.step()
                p.grad = None

            p.register_post_accumulate_grad_hook(step)
    x, y = data()
    for _ in range(3):  # the first run captures
        for pipe in (eager, graphed):
            user_loop(pipe, x, y)
        for a, b in zip(graphed.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a, b)
    assert all(p.grad is None for p in graphed.parameters())


@pytest.mark.filterwarnings("error::mpstream.runtime.graphed.GraphWarning")  # nothing lost
@pytest.mark.parametrize(
    ("how", "schedule"),
    # (under zb_h1 the hook runs after the first stage's last add: None either way)
    [
        ("none", "gpipe"),
        ("none", "1f1b"),
        ("other", "gpipe"),
        ("other", "1f1b"),
        ("other", "zb_h1"),
    ],
)
def test_a_hook_that_takes_other_parameters_grad_away_loses_no_gradient(
    how: str, schedule: str
) -> None:
    # A hook on the last stage's weight sets the first stage's .grad to None
    # (or to a copy of it): that store, which ran no hook, must attach them
    # again before its next micro-batch adds, as eager autograd starts a
    # fresh .grad (or adds into the copy).
    eager, graphed = pair(mlp(WIDTHS), chunks=4, schedule=schedule)
    for pipe in (eager, graphed):
        first = list(pipe[0].parameters())

        def take(p: Tensor, first: list[nn.Parameter] = first) -> None:
            for q in first:
                q.grad = None if how == "none" or q.grad is None else q.grad.clone()

        pipe[6].weight.register_post_accumulate_grad_hook(take)
    x, y = data()
    for _ in range(3):  # the first step captures
        for pipe in (eager, graphed):
            pipe.train_step(x, y, nn.MSELoss())
        assert_same_grads(graphed, eager)


def test_autograd_grad_through_a_graphed_stage_runs_no_hook() -> None:
    eager, graphed = pair(mlp(WIDTHS), chunks=2)
    x, y = data()
    for pipe in (eager, graphed):
        user_loop(pipe, x, y)  # captures
        pipe.zero_grad(set_to_none=True)
    ran = Counter[str]()
    for tag, pipe in (("eager", eager), ("graphed", graphed)):
        for p in pipe.parameters():
            p.register_post_accumulate_grad_hook(lambda p, tag=tag: ran.update([tag]))
        inp = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(nn.functional.mse_loss(pipe(inp), y), [inp])
        assert g.shape == x.shape
    assert ran == Counter()  # autograd accumulates nothing here, so no hook runs
    assert all(p.grad is None for p in graphed.parameters())


def test_a_backward_pass_is_asked_once_whether_it_accumulates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mpstream.runtime import private

    # 4 micro-batches over 2 stages: 8 replayed backward tasks per pass,
    # one question to torch. Passes of either kind in turn keep their own
    # answer: .grad as eager autograd leaves it.
    eager, graphed = pair(mlp(WIDTHS), chunks=4)
    x, y = data()
    for pipe in (eager, graphed):
        user_loop(pipe, x, y)  # captures
    asked: list[object] = []
    real = private.will_engine_execute_node

    def counted(node: object) -> bool:
        asked.append(node)
        return real(node)

    monkeypatch.setattr(private, "will_engine_execute_node", counted)
    user_loop(graphed, x, y)
    assert len(asked) == 1
    for pipe in (eager, graphed):
        inp = x.clone().requires_grad_()
        torch.autograd.grad(nn.functional.mse_loss(pipe(inp), y), [inp])
        nn.functional.mse_loss(pipe(inp), y).backward(inputs=[inp])
        user_loop(pipe, x, y)
    user_loop(eager, x, y)
    assert len(asked) == 4
    assert_same_grads(graphed, eager)


def test_where_torch_cannot_tell_the_pass_each_replayed_backward_asks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mpstream.runtime import private, replay_autograd

    # Pass id -1 (a torch without the call): no answer is kept, as -1 is
    # also what the kept answer starts from (a False one would drop every
    # gradient a plain backward then adds).
    eager, graphed = pair(mlp(WIDTHS), chunks=4)
    x, y = data()
    for pipe in (eager, graphed):
        user_loop(pipe, x, y)  # captures
    monkeypatch.setattr(private, "current_graph_task_id", lambda: -1)
    monkeypatch.setattr(replay_autograd, "_ANSWERED", (-1, False))
    asked: list[object] = []
    real = private.will_engine_execute_node

    def counted(node: object) -> bool:
        asked.append(node)
        return real(node)

    monkeypatch.setattr(private, "will_engine_execute_node", counted)
    for pipe in (eager, graphed):
        pipe.zero_grad()
        inp = x.clone().requires_grad_()
        torch.autograd.grad(nn.functional.mse_loss(pipe(inp), y), [inp])
        user_loop(pipe, x, y)
    assert len(asked) == 16  # each of a pass's 8 replayed backward tasks
    assert_same_grads(graphed, eager)


@pytest.mark.parametrize("run", RUNS)
def test_a_tied_weight_s_hooks_run_once_its_pass_is_summed(run: str) -> None:
    eager, graphed = pair(tied_model(), chunks=3, balance=[2, 2, 2], devices=["cpu"] * 3)
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)
    for pipe in (eager, graphed):  # the capture's pass runs eagerly
        RUNS[run](pipe, x, y)
    seen: list[list[Tensor]] = [[], []]
    for pipe, out in zip((eager, graphed), seen):
        pipe[0].weight.register_post_accumulate_grad_hook(
            lambda p, out=out: out.append(p.grad.clone())  # type: ignore[union-attr]
        )
    for _ in range(2):
        for pipe in (eager, graphed):
            RUNS[run](pipe, x, y)
    # Graphed: once per pass, after both stages' sums are in (eager runs
    # them after each accumulation); the last value is the same.
    assert len(seen[1]) == 2 and len(seen[0]) >= 2
    torch.testing.assert_close(seen[1][-1], seen[0][-1])
    assert_same_grads(graphed, eager)


def test_a_torch_without_the_private_call_is_an_error_not_lost_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mpstream.runtime import private

    _, graphed = pair(mlp(WIDTHS), chunks=2)
    x, y = data()
    user_loop(graphed, x, y)  # captures
    real = private.lookup
    monkeypatch.setattr(
        private,
        "lookup",
        lambda p: None if p.name == "_will_engine_execute_node" else real(p),
    )
    with pytest.raises(private.PrivateApiError, match="_will_engine_execute_node"):
        user_loop(graphed, x, y)


@pytest.mark.parametrize("run", RUNS)
def test_parameters_hooks_are_scanned_again_only_once_a_hook_was_registered(
    run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mpstream.runtime.graphed import grads, state

    # Scanning every parameter's hooks at every run and pass was per-parameter
    # host work per step; a hook registered later is still seen, of either
    # kind: a post-accumulate hook runs, a tensor hook turns the stage eager.
    eager, graphed = pair(mlp(WIDTHS), chunks=4)
    x, y = data()
    for _ in range(2):  # captures, then replays
        for pipe in (eager, graphed):
            RUNS[run](pipe, x, y)
    read: Counter[str] = Counter()
    for module, kind in ((state, "tensor"), (grads, "post")):
        real = module._hooks  # type: ignore[attr-defined]
        monkeypatch.setattr(
            module, "_hooks", lambda p, real=real, kind=kind: read.update([kind]) or real(p)
        )
    for pipe in (eager, graphed):  # the eager pipe has no graphs to scan for
        RUNS[run](pipe, x, y)
    assert read == Counter()
    counts = [count_accumulations(pipe) for pipe in (eager, graphed)]
    for pipe in (eager, graphed):
        RUNS[run](pipe, x, y)
    assert read["post"] > 0 and counts[1] == counts[0] and counts[0]
    assert_same_grads(graphed, eager)
    tapped: Counter[str] = Counter()
    for tag, pipe in (("eager", eager), ("graphed", graphed)):
        pipe[0].bias.register_hook(lambda g, tag=tag: tapped.update([tag]))
    RUNS[run](eager, x, y)
    with pytest.warns(GraphWarning, match="tensor hook"):
        RUNS[run](graphed, x, y)
    assert tapped["graphed"] == tapped["eager"] > 0
    assert_same_grads(graphed, eager)

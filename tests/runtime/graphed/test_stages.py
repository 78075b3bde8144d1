"""Graphed stages: equal to the eager pipe on every schedule and checkpoint
mode, graphs per slot and signature, recapture of replaced tensors (eager
fallbacks with one warning: test_fallbacks.py; the calls a stage keeps:
test_bounds.py).

On the CPU the replays are emulated (:class:`~mpstream.runtime.graphed.emulated.Emulated`):
each slot keeps one set of activations, which the next forward into the
slot replaces, as a CUDA graph's static memory would. test_stages_cuda.py runs
the real graphs."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe, verify_plan
from mpstream.runtime import replay_autograd as replay
from mpstream.runtime.graphed import call as call_module
from mpstream.runtime.plan import Plan
from mpstream.schedules import SCHEDULES, placement_of
from tests.helpers import assert_same_grads, mlp
from tests.runtime.graphed.pairs import CHECKPOINTS, WIDTHS, data, pair


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_train_step_equals_the_eager_pipe(schedule: str, checkpoint: str) -> None:
    extra = (
        {"virtual_stages": 2, "balance": [2, 2, 2, 2], "devices": ["cpu"] * 4}
        if placement_of(schedule) != "stage"
        else {}
    )
    eager, graphed = pair(
        mlp(WIDTHS), split_size=3, schedule=schedule, checkpoint=checkpoint, **extra
    )
    x, y = data()  # 10 rows, micro-batches of 3: the last one smaller
    for _ in range(2):  # the second step replays
        torch.testing.assert_close(
            graphed.train_step(x, y, nn.MSELoss()), eager.train_step(x, y, nn.MSELoss())
        )
    assert_same_grads(graphed, eager)
    report = graphed.graph_report()
    # A split backward (zero-bubble, micro-batches not checkpointed) has its
    # weight pass graphed apart.
    split = schedule in ("zb_h1", "interleaved_zb", "zbv") and checkpoint != "always"
    assert all(s.graphed for s in report.stages)
    if schedule == "dualpipev" and checkpoint != "always":
        # Its steady state runs whole backwards, its warm-up and cool-down
        # split ones (except_last: only the last micro-batch may split).
        assert any("weight" in s.passes for s in report.stages)
    elif split:
        # The first stage's inputs need no gradient: a split call has no B
        # (the checkpointed micro-batches of except_last have a whole backward).
        every = ("forward", "backward", "weight")
        first = ("forward", "weight") if checkpoint == "never" else every
        assert [s.passes for s in report.stages] == [first] + [every] * (len(report.stages) - 1)
    else:
        assert all(s.passes == ("forward", "backward") for s in report.stages)
    assert report.stages[0].slots >= 1


def test_autograd_sees_no_parameter_of_a_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    # The graphs add every parameter gradient into the stage's buffers, so
    # autograd walks no edge per parameter at a micro-batch's backward (on
    # the host about 4 us each, hundreds per ResNet stage); a training step
    # does not go through autograd at all.
    seen: list[int] = []
    apply = replay.Replay.apply

    def counting(call: call_module.GraphedCall, anchor: Tensor, *tensors: Tensor) -> object:
        seen.append(len(tensors) - len(call.where))
        return apply(call, anchor, *tensors)

    monkeypatch.setattr(replay.Replay, "apply", counting)
    eager, graphed = pair(mlp(WIDTHS), split_size=3)
    x, y = data()
    for _ in range(2):
        torch.testing.assert_close(
            graphed.train_step(x, y, nn.MSELoss()), eager.train_step(x, y, nn.MSELoss())
        )
    assert_same_grads(graphed, eager)
    assert seen == []  # the step's tasks replay the graphs themselves
    for pipe in (eager, graphed):
        pipe.zero_grad()
        nn.functional.mse_loss(pipe(x), y).backward()
    assert_same_grads(graphed, eager)
    assert seen and all(params == 0 for params in seen)


def test_the_users_own_loop_with_an_optimizer_equals_eager() -> None:
    eager, graphed = pair(mlp(WIDTHS), chunks=4)
    opts = [torch.optim.SGD(p.parameters(), lr=0.1, momentum=0.9) for p in (eager, graphed)]
    x, y = data()
    for _ in range(3):
        for pipe, opt in zip((eager, graphed), opts):
            opt.zero_grad()  # set_to_none: the graphs do not hold .grad
            nn.functional.mse_loss(pipe(x), y).backward()
            opt.step()  # in place: the next replay reads the new values
    for a, b in zip(graphed.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b)
    with torch.no_grad():  # inference: forward graphs only
        torch.testing.assert_close(graphed(x), eager(x))


def test_gradient_accumulation_over_two_forwards_before_one_backward() -> None:
    eager, graphed = pair(mlp(WIDTHS), chunks=2)
    x1, y1 = data()
    x2, y2 = data()
    for pipe in (eager, graphed):
        loss = nn.functional.mse_loss(pipe(x1), y1) + nn.functional.mse_loss(pipe(x2), y2)
        loss.backward()
    # The second forward found the first one's slots waiting for their
    # backward and took graphs of its own.
    assert_same_grads(graphed, eager)
    assert graphed.graph_report().stages[0].graphs == 2 * 2 * 2  # slots x generations x passes


def test_a_second_backward_through_a_replayed_forward_is_refused() -> None:
    # A graph's backward reuses the memory of the activations it read.
    _, graphed = pair(mlp(WIDTHS), chunks=1)
    x, y = data()
    loss = nn.functional.mse_loss(graphed(x), y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second backward through the same graphed forward"):
        loss.backward()
    nn.functional.mse_loss(graphed(x), y).backward()  # the next step runs


def test_a_backward_with_create_graph_is_refused() -> None:
    # A replayed backward runs no autograd: a gradient penalty would get
    # gradients without history.
    _, graphed = pair(mlp(WIDTHS), chunks=2)
    x, y = data()
    for _ in range(2):  # capture, then replay
        loss = nn.functional.mse_loss(graphed(x), y)
        with pytest.raises(RuntimeError, match="create_graph=True .* run the pipe with graphs=F"):
            loss.backward(create_graph=True)
    nn.functional.mse_loss(graphed(x), y).backward()  # the next step runs
    assert all(p.grad is not None for p in graphed.parameters())


def test_dropout_draws_what_the_eager_pipe_draws_with_the_same_seed() -> None:
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 4)).double()
    eager, graphed = pair(model, chunks=2, balance=[2, 1])
    x, _ = data()
    torch.manual_seed(7)
    want = eager(x)
    torch.manual_seed(7)
    torch.testing.assert_close(graphed(x), want)


def test_replaced_tensors_and_modules_are_captured_again() -> None:
    layers = list(mlp(WIDTHS))
    layers[4] = nn.Sequential(layers[4])  # a layer holding a module to swap
    eager, graphed = pair(nn.Sequential(*layers), chunks=2)
    x, y = data()

    def step() -> None:
        for pipe in (eager, graphed):
            pipe.zero_grad()
            nn.functional.mse_loss(pipe(x), y).backward()
        for a, b in zip(graphed.parameters(), eager.parameters()):
            assert (a.grad is None) == (b.grad is None)
            if a.grad is not None:
                torch.testing.assert_close(a.grad, b.grad)

    step()
    captures = graphed.graph_report().stages[0].captures
    for pipe in (eager, graphed):  # a parameter replaced (a new tensor, not in place)
        pipe.partitions[0][0].weight = nn.Parameter(torch.ones_like(pipe.partitions[0][0].weight))
    step()
    report = graphed.graph_report().stages[0]
    assert report.recaptures > 0 and report.captures > captures
    for pipe in (eager, graphed):  # requires_grad changed
        pipe.partitions[0][0].bias.requires_grad_(False)
    step()
    for pipe in (eager, graphed):  # a module swapped inside a layer
        pipe.partitions[1][0][0] = nn.Linear(12, 8).double()
        pipe.partitions[1][0][0].load_state_dict(eager.partitions[1][0][0].state_dict())
    step()
    assert graphed.graph_report().stages[1].recaptures > 0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="build it with Pipe"):
        Pipe(mlp(WIDTHS), balance=[4, 4], devices=["cpu", "cpu"]).graph_report()
    with pytest.raises(ValueError, match="choose one"):
        Pipe(mlp(WIDTHS), balance=[4, 4], devices=["cpu", "cpu"], graphs=True, compile=True)
    with pytest.raises(TypeError, match="graphs must be True, False or a graph backend"):
        Pipe(mlp(WIDTHS), balance=[4, 4], devices=["cpu", "cpu"], graphs="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_graphed_stages_issue_the_eager_event_plan(schedule: str) -> None:
    # A replay is the task's work: the streams, waits and records around it
    # are the eager pipe's, and verify_plan proves them.
    eager, graphed = pair(mlp(WIDTHS), chunks=3, schedule=schedule, force_copies=True)
    x, y = data()
    plans = []
    for pipe in (eager, graphed):
        pipe.train_step(x, y, nn.MSELoss())  # capture first: the second step replays
        sched = pipe.scheduler
        sched.recording = True
        pipe.train_step(x, y, nn.MSELoss())
        sched.recording = False
        plans.append(sched.plan())
        verify_plan(Plan(sched.plan(), sched.slot_names, sched.slot_devices, 2))
    assert plans[0] == plans[1]


def test_autocast_calls_get_graphs_of_their_own() -> None:
    eager, graphed = pair(mlp(WIDTHS, torch.float32), chunks=2)
    x, y = (t.float() for t in data())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(graphed(x), eager(x))
    before = graphed.graph_report().stages[0].graphs
    torch.testing.assert_close(graphed(x), eager(x))  # autocast off: another key
    assert graphed.graph_report().stages[0].graphs > before


def test_inference_mode_and_no_grad_have_graphs_of_their_own() -> None:
    eager, graphed = pair(mlp(WIDTHS), chunks=2)
    x, _ = data()
    with torch.inference_mode():
        torch.testing.assert_close(graphed(x), eager(x))
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), eager(x))


def test_input_gradients_do_not_alias_the_graphs_buffers() -> None:
    # torch.autograd.grad through graphed stages: the input's gradient is a
    # copy (the next replay rewrites the buffers), and .grad is left alone.
    eager, graphed = pair(mlp(WIDTHS), chunks=2)
    x, y = data()
    for pipe in (eager, graphed):
        pipe.train_step(x, y, nn.MSELoss())
    got = []
    for pipe in (eager, graphed):
        first = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(nn.functional.mse_loss(pipe(first), y), first)
        again = (2 * x).requires_grad_()
        (h,) = torch.autograd.grad(nn.functional.mse_loss(pipe(again), y), again)
        got.append((g, h))
    torch.testing.assert_close(got[1], got[0])
    assert got[1][0].data_ptr() != got[1][1].data_ptr()
    assert_same_grads(graphed, eager)  # what the step left


def test_parameter_gradients_through_torch_autograd_grad_are_refused() -> None:
    # The graphs add parameter gradients into .grad; autograd sees no
    # parameter, and says so (never a silent None where eager gives one).
    _, graphed = pair(mlp(WIDTHS), chunks=2)
    x, y = data()
    loss = nn.functional.mse_loss(graphed(x), y)
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        torch.autograd.grad(loss, list(graphed.parameters()))


def test_capture_follows_the_schedule_s_execution_order() -> None:
    _, graphed = pair(mlp(WIDTHS), chunks=4, schedule="1f1b")
    x, y = data(8)
    graphed.train_step(x, y, nn.MSELoss())
    graphs = graphed._rt().worker.graphs
    assert graphs is not None and graphs.slots is not None
    forwards = [(s, k) for s, k, kind in graphs.slots.order if kind.label == "forward"]
    assert graphs.order == forwards  # each slot's graphs captured at its first forward

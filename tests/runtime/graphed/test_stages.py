"""Graphed stages: equal to the eager pipe on every schedule and checkpoint
mode, graphs per slot and signature, recapture of replaced tensors, eager
fallbacks with one warning (the calls a stage keeps: test_bounds.py).

On the CPU the replays are emulated (:class:`~mpstream.runtime.graphed.emulated.Emulated`):
each slot keeps one set of activations, which the next forward into the
slot replaces, as a CUDA graph's static memory would. test_stages_cuda.py runs
the real graphs."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe, verify_plan
from mpstream.runtime import replay_autograd as replay
from mpstream.runtime.graphed import Emulated, GraphWarning
from mpstream.runtime.graphed import call as call_module
from mpstream.runtime.plan import Plan
from mpstream.schedules import SCHEDULES, placement_of
from tests.helpers import assert_same_grads, mlp
from tests.models import FailOnce

CHECKPOINTS = ["never", "except_last", "always"]
WIDTHS = [6, 12, 12, 8, 4]


def pair(model: nn.Module, graphs: object = None, **kwargs: object) -> tuple[Pipe, Pipe]:
    """The same pipe twice: eager, and graphed (emulated unless given)."""
    kwargs.setdefault("balance", [4, 4])
    kwargs.setdefault("devices", ["cpu", "cpu"])
    eager = Pipe(copy.deepcopy(model), **kwargs)  # type: ignore[arg-type]
    graphed = Pipe(copy.deepcopy(model), graphs=graphs or Emulated(), **kwargs)  # type: ignore[arg-type]
    return eager, graphed


def data(batch: int = 10) -> tuple[Tensor, Tensor]:
    return torch.randn(batch, WIDTHS[0], dtype=torch.float64), torch.randn(
        batch, WIDTHS[-1], dtype=torch.float64
    )


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


def test_a_stage_that_cannot_be_captured_runs_eagerly_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = Emulated()
    real = backend.capture
    eager, graphed = pair(mlp(WIDTHS), graphs=backend, chunks=2)

    def refuse(call: object, fn: object) -> None:
        if fn is graphed.partitions[1]:
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")
        real(call, fn)  # type: ignore[arg-type]

    monkeypatch.setattr(backend, "capture", refuse)
    x, y = data()
    with pytest.warns(
        GraphWarning,
        match="stage 1 of 2 .* runs eagerly: capture failed: "
        "RuntimeError: operation not permitted when stream is capturing$",
    ):
        got = graphed.train_step(x, y, nn.MSELoss())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once, not at every call
        graphed.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(got, eager.train_step(x, y, nn.MSELoss()))
    first, second = graphed.graph_report().stages
    assert first.graphed and not second.graphed and second.graphs == 0
    assert "operation not permitted" in str(graphed.graph_report())


@pytest.mark.parametrize("loop", [False, True], ids=["train_step", "user loop"])
def test_the_stages_own_error_while_capturing_reaches_the_caller_and_graphs_stay_on(
    loop: bool,
) -> None:
    # Raised while the backend runs the stage eagerly before capturing: no
    # capture failed, so the stage is not made eager for good, nor run again.
    model = nn.Sequential(
        mlp([6, 8]), FailOnce(1, ValueError("the stage's own error")), mlp([8, 4])
    )
    eager, graphed = pair(model, graphs=Emulated(), chunks=2, balance=[2, 1])
    x, y = data()
    loss_fn = nn.MSELoss()

    def step(pipe: Pipe) -> None:
        if loop:
            loss_fn(pipe(x), y).backward()
        else:
            pipe.train_step(x, y, loss_fn)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no GraphWarning: nothing fell back
        with pytest.raises(ValueError, match="the stage's own error"):
            step(graphed)
    assert graphed.partitions[0][1].calls == 1  # not run a second time eagerly
    assert all(p.grad is None for p in graphed.parameters())
    eager.partitions[0][1].calls = 1
    for _ in range(2):
        step(graphed)
        step(eager)
    assert_same_grads(graphed, eager)
    assert all(s.graphed for s in graphed.graph_report().stages)


def test_on_the_cpu_graphs_true_runs_eagerly_and_says_why() -> None:
    eager, graphed = pair(mlp(WIDTHS), graphs=True, chunks=2)
    x, y = data()
    with pytest.warns(GraphWarning, match="runs eagerly: on cpu: CUDA graphs need") as warned:
        loss = graphed.train_step(x, y, nn.MSELoss())
    assert len(warned) == 2  # once per stage
    torch.testing.assert_close(loss, eager.train_step(x, y, nn.MSELoss()))
    assert_same_grads(graphed, eager)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphWarning)
        graphed(x)  # said once
    report = graphed.graph_report()
    assert report.graphs == 0
    assert [s.reason for s in report.stages] == ["on cpu: CUDA graphs need a CUDA device"] * 2


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


def test_what_a_graph_cannot_hold_runs_eagerly_and_says_why() -> None:
    # A parameter hook: the replay and autograd would both run it.
    eager, graphed = pair(mlp(WIDTHS), chunks=2)
    for pipe in (eager, graphed):
        pipe.partitions[1][0].weight.register_hook(lambda g: g * 0.5)
    x, y = data()
    with pytest.warns(GraphWarning, match="stage 1 of 2 .* parameter '4.weight' has a tensor hook"):
        nn.functional.mse_loss(graphed(x), y).backward()
    nn.functional.mse_loss(eager(x), y).backward()
    assert_same_grads(graphed, eager)  # the hook ran once
    assert graphed.graph_report().stages[0].graphed


class Unregistered(nn.Module):
    """Holds a tensor that needs a gradient without registering it."""

    def __init__(self) -> None:
        super().__init__()
        self.__dict__["scale"] = torch.ones(WIDTHS[1], dtype=torch.float64, requires_grad=True)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


def test_a_tensor_outside_the_parameters_that_needs_a_gradient_keeps_its_stage_eager() -> None:
    model = nn.Sequential(nn.Linear(WIDTHS[0], WIDTHS[1]), Unregistered(), nn.Linear(WIDTHS[1], 4))
    model.double()
    eager, graphed = pair(model, chunks=2, balance=[1, 2])
    x, y = data()
    with pytest.warns(GraphWarning, match="not a parameter of the stage needs a gradient"):
        nn.functional.mse_loss(graphed(x), y).backward()
    nn.functional.mse_loss(eager(x), y).backward()
    nn.functional.mse_loss(model(x), y).backward()  # the unsplit model
    expected = model[1].scale.grad
    assert expected is not None and expected.abs().sum() > 0
    for pipe in (eager, graphed):
        torch.testing.assert_close(pipe.partitions[1][0].scale.grad, expected)
    assert_same_grads(graphed, eager)


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
    graphs = graphed._rt()[1].graphs
    assert graphs is not None and graphs.slots is not None
    forwards = [(s, k) for s, k, kind in graphs.slots.order if kind.label == "forward"]
    assert graphs.order == forwards  # each slot's graphs captured at its first forward


class _Broken(nn.Module):
    """Raises while ``broken`` (an error of its own, fixed later)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.broken = True

    def forward(self, x: Tensor) -> Tensor:
        if self.broken:
            raise RuntimeError("transient failure")
        return self.lin(x)


def test_a_stage_failing_at_its_first_call_stays_graphed() -> None:
    # Its own error, raised eagerly too, is not a failed capture.
    model = nn.Sequential(*mlp(WIDTHS[:4]), _Broken()).double()
    _, graphed = pair(model, chunks=2, balance=[6, 1])
    x, y = data()
    with pytest.raises(RuntimeError, match="transient failure"):
        graphed(x)
    graphed[6].broken = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphWarning)
        nn.functional.mse_loss(graphed(x), y).backward()
    assert all(s.graphed for s in graphed.graph_report().stages)


class _Armed(nn.Module):
    """Raises while ``armed`` is set; passes its input on otherwise."""

    armed = False

    def forward(self, x: Tensor) -> Tensor:
        if self.armed:
            raise RuntimeError("armed")
        return x


def test_failed_calls_whose_exceptions_are_held_leave_no_call_busy() -> None:
    # A failed pipe(x)'s traceback holds its first stage's outputs, and so
    # the graphs of their calls: past MAX_GENERATIONS exceptions held, the
    # next calls ran eagerly, with a warning about forwards awaiting their
    # backward. A forward that succeeded still awaits its own.
    model = nn.Sequential(*mlp(WIDTHS), _Armed()).double()
    eager, graphed = pair(model, chunks=2, balance=[4, 5])
    x, y = data()
    kept = {pipe: pipe(x) for pipe in (eager, graphed)}  # its backward comes last
    held: list[BaseException] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphWarning)
        for _ in range(6):
            for pipe in (eager, graphed):
                pipe[8].armed = True
                try:
                    pipe(x)
                except RuntimeError as exc:
                    held.append(exc)
                pipe[8].armed = False
                nn.functional.mse_loss(pipe(x), y).backward()
    assert len(held) == 12
    for out in kept.values():
        nn.functional.mse_loss(out, y).backward()
    assert_same_grads(graphed, eager)
    assert all(s.graphed for s in graphed.graph_report().stages)


def test_a_lazy_module_is_graphed_from_its_second_run() -> None:
    model = nn.Sequential(nn.LazyLinear(12), nn.Tanh(), nn.Linear(12, 4)).double()
    eager, graphed = pair(model, chunks=2, balance=[2, 1])
    x, y = data()
    for _ in range(3):
        for pipe in (eager, graphed):
            pipe.zero_grad()
            nn.functional.mse_loss(pipe(x), y).backward()
    graphed.load_state_dict(eager.state_dict())  # initialised alike by their first runs
    for pipe in (eager, graphed):
        pipe.zero_grad()
        nn.functional.mse_loss(pipe(x), y).backward()
    assert_same_grads(graphed, eager)
    assert graphed.graph_report().stages[0].captures > 0

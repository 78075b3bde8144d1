"""Graphed stages that fall back: a stage that cannot be captured (or what a
graph cannot hold) runs eagerly with one warning saying why, graphs=True on
the CPU says why it runs eagerly, a stage's own error while capturing
reaches the caller with graphs kept on, a stage failing at its first call
stays graphed, failed calls leave no call busy (a run refused inside
another leaves that one's to it), and a lazy module is graphed
from its second run (replays emulated on the CPU, see test_stages.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated, GraphWarning
from tests.helpers import assert_same_grads, mlp
from tests.models import FailOnce
from tests.runtime.graphed.pairs import WIDTHS, data, pair


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


def test_a_run_refused_inside_another_leaves_that_run_s_calls_to_its_failure() -> None:
    # forward.run entered from inside a stage (straight through the runtime)
    # is refused as it begins, and abandons a run that never began: the run
    # in progress, failing after, must still release the calls it replayed.
    _, graphed = pair(mlp(WIDTHS), chunks=2)
    x, _ = data()
    graphed(x)  # captures
    graphs = graphed._rt().worker.graphs
    assert graphs is not None
    before = graphs.runs
    graphed(x)  # the outer run: its calls await a backward
    calls = [c for st in graphs.stages for c in st.calls.values()]
    assert any(c.pending is not None for c in calls)
    graphs.abandon(graphs.runs)  # the refused inner run's
    graphs.abandon(before)  # the outer run's, as it fails
    assert all(c.pending is None for c in calls)


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

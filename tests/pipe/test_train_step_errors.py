"""Pipe.train_step's bad arguments and failures: a step that fails in a
forward or a backward leaves gradients and BatchNorm statistics as they were,
and the next step works."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe, verify_plan
from mpstream.runtime import training
from mpstream.runtime.microbatch import scatter
from mpstream.runtime.plan import Plan
from mpstream.runtime.scheduler import EventScheduler
from mpstream.runtime.worker import Worker
from mpstream.schedules.schedule import Schedule
from tests.helpers import assert_same_grads, mlp, virtual_for
from tests.pipe.test_train_step import BATCH, MODES, RANKED, SCHEDULES, reference_step


def small_pipe(**kw: object) -> Pipe:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    kw.setdefault("virtual_stages", virtual_for(kw.get("schedule"), 2))
    return Pipe(model, split_size=4, balance=[2, 1], devices=["cpu", "cpu"], **kw)  # type: ignore[arg-type]


def data() -> tuple[Tensor, Tensor]:
    return torch.randn(BATCH, 4, dtype=torch.float64), torch.randn(BATCH, 2, dtype=torch.float64)


def test_bad_arguments() -> None:
    pipe = small_pipe()
    x, y = data()
    with pytest.raises(ValueError, match="reduction must be one of 'mean', 'sum'"):
        pipe.train_step(x, y, nn.MSELoss(), reduction="avg")
    with pytest.raises(ValueError, match="target has batch size 3 but inputs have 10"):
        pipe.train_step(x, y[:3], nn.MSELoss())
    with pytest.raises(TypeError, match="target"):
        pipe.train_step(x, "labels", nn.MSELoss())  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match="loss_fn must return a scalar tensor, got a tensor of shape"
    ):
        pipe.train_step(x, y, nn.MSELoss(reduction="none"))
    with pytest.raises(ValueError, match="schedule must be one of 'gpipe', '1f1b'"):
        small_pipe(schedule="interleaved")
    with torch.inference_mode(), pytest.raises(RuntimeError, match="under torch.inference_mode"):
        pipe.train_step(x, y, nn.MSELoss())
    with torch.no_grad():  # train_step enables gradients itself
        pipe.train_step(x, y, nn.MSELoss())
    assert all(p.grad is not None for p in pipe.parameters())


@pytest.mark.parametrize("schedule", SCHEDULES + RANKED)
@pytest.mark.parametrize("had_grads", [False, True])
def test_failure_restores_gradients_and_batchnorm(schedule: str, had_grads: bool) -> None:
    pipe = small_pipe(schedule=schedule)
    x, y = data()
    if had_grads:
        pipe.train_step(x, y, nn.MSELoss())
    before_grads = [None if p.grad is None else p.grad.clone() for p in pipe.parameters()]
    before_stats = [b.clone() for b in pipe.buffers()]
    calls = 0

    def flaky(out: Tensor, target: Tensor) -> Tensor:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyError("loss failed on micro-batch 2")
        return nn.functional.mse_loss(out, target)

    with pytest.raises(KeyError, match="micro-batch 2"):
        pipe.train_step(x, y, flaky)
    for p, g in zip(pipe.parameters(), before_grads):
        if g is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, g)
    for b, saved in zip(pipe.buffers(), before_stats):
        torch.testing.assert_close(b, saved)
    assert not pipe.scheduler.native.running
    pipe.train_step(x, y, nn.MSELoss())  # the next step works


@pytest.mark.parametrize("schedule", SCHEDULES + RANKED)
@pytest.mark.parametrize("checkpoint", MODES)
def test_forced_copies_give_the_same_step(schedule: str, checkpoint: str) -> None:
    model = mlp([4, 5, 6, 5, 3])
    ref = copy.deepcopy(model)
    pipe = Pipe(
        model,
        split_size=3,
        balance=[2, 2, 2, 2],
        devices=["cpu"] * 4,
        schedule=schedule,
        checkpoint=checkpoint,
        force_copies=True,
        virtual_stages=virtual_for(schedule, 4),
    )
    x, y = torch.randn(BATCH, 4, dtype=torch.float64), torch.randn(BATCH, 3, dtype=torch.float64)
    loss = pipe.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(loss, reference_step(ref, x, y, nn.MSELoss()))
    assert_same_grads(model, ref)


def test_target_tasks_move_targets_ahead_of_the_last_stage() -> None:
    """Targets not on the last stage's device move in tasks of their own
    (issued with the inputs), not inside the last stage's forward."""
    model = mlp([4, 5, 3])
    ref = copy.deepcopy(model)
    sched = EventScheduler([torch.device("cpu")] * 2)
    worker = Worker([model[0:2], model[2:4]], sched)
    x, y = torch.randn(BATCH, 4, dtype=torch.float64), torch.randn(BATCH, 3, dtype=torch.float64)
    micro, targets = scatter(x, None, 4), scatter(y, None, 4)
    for name in SCHEDULES:
        model.zero_grad()
        schedule = Schedule(name, 2, len(micro), [False, False], backward=True, copy_target=True)
        sched.recording = True
        sched.clear_plan()
        batches = [(b,) for b in micro]
        loss = training.run(worker, batches, targets, schedule, nn.MSELoss(), [0.4, 0.4, 0.2])
        plan = Plan(sched.plan(), sched.slot_names, sched.slot_devices, 2)
        verify_plan(plan)
        runs = [op for op in plan.ops if op.op == "run"]
        assert [(op.kind, op.micro) for op in runs if op.kind == "target"] == [
            ("target", m) for m in range(3)
        ]
        first_forward = next(i for i, op in enumerate(runs) if op.kind == "forward")
        assert runs[first_forward - 1].kind == "target"  # issued ahead, with the input
        assert {plan.slot_names[op.slot] for op in runs if op.kind == "target"} == {"io@cpu"}
        ref.zero_grad()
        expected = reference_step(ref, x, y, nn.MSELoss())
        torch.testing.assert_close(loss, expected)
        assert_same_grads(model, ref)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_existing_gradients_are_saved_only_when_a_backward_begins(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mpstream.pipe.snapshot import Snapshot

    saved: list[int] = []
    real = Snapshot.save_grads

    def spy(self: object, stage: int) -> None:
        saved.append(stage)
        real(self, stage)  # type: ignore[arg-type]

    monkeypatch.setattr(Snapshot, "save_grads", spy)
    pipe = small_pipe(schedule=schedule)
    x, y = data()
    pipe.train_step(x, y, nn.MSELoss())  # gradients exist from now on
    saved.clear()

    def fails_last(out: Tensor, target: Tensor) -> Tensor:
        if out.shape[0] < 4:  # the last (uneven) micro-batch
            raise KeyError("loss failed")
        return nn.functional.mse_loss(out, target)

    before = [p.grad.clone() for p in pipe.parameters()]  # type: ignore[union-attr]
    with pytest.raises(KeyError):
        pipe.train_step(x, y, fails_last)
    # gpipe fails before any backward: nothing cloned. 1f1b interleaves
    # backwards (the last stage's first) before the failing forward.
    assert saved == [] if schedule == "gpipe" else saved[0] == 1
    for p, g in zip(pipe.parameters(), before):
        torch.testing.assert_close(p.grad, g)
    saved.clear()
    pipe.train_step(x, y, nn.MSELoss())
    assert sorted(saved) == [0, 1]


class FailingBackward(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx: object, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> Tensor:  # type: ignore[override]
        FailingBackward.calls += 1
        if FailingBackward.calls == 2:
            raise KeyError("backward failed")
        return grad


class FailOnSecondBackward(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return FailingBackward.apply(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_failed_backward_restores_accumulated_gradients(schedule: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), FailOnSecondBackward(), nn.Linear(4, 2)).double()
    pipe = Pipe(model, split_size=4, balance=[2, 1], devices=["cpu", "cpu"], schedule=schedule)
    x, y = data()
    FailingBackward.calls = -100
    pipe.train_step(x, y, nn.MSELoss())
    before = [p.grad.clone() for p in pipe.parameters()]  # type: ignore[union-attr]
    FailingBackward.calls = 0
    with pytest.raises(KeyError, match="backward failed"):
        pipe.train_step(x, y, nn.MSELoss())
    for p, g in zip(pipe.parameters(), before):
        torch.testing.assert_close(p.grad, g)
    FailingBackward.calls = -100
    pipe.train_step(x, y, nn.MSELoss())
    for p, g in zip(pipe.parameters(), before):
        torch.testing.assert_close(p.grad, 2 * g)


def test_a_failed_step_restores_the_gradient_tensors_in_place() -> None:
    # Views of .grad (DDP's gradient buckets) must see the restored values.
    pipe = small_pipe(schedule="1f1b")
    x, y = data()
    pipe.train_step(x, y, nn.MSELoss())
    grads = [p.grad for p in pipe.parameters()]
    saved = [g.clone() for g in grads]  # type: ignore[union-attr]

    def failing(out: Tensor, target: Tensor) -> Tensor:
        if failing.calls == 1:  # type: ignore[attr-defined]
            raise RuntimeError("boom")  # micro-batch 1's loss: after micro-batch 0's backward
        failing.calls += 1  # type: ignore[attr-defined]
        return nn.functional.mse_loss(out, target)

    failing.calls = 0  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="boom"):
        pipe.train_step(x, y, failing)
    for p, g, s in zip(pipe.parameters(), grads, saved):
        assert p.grad is g
        torch.testing.assert_close(g, s)


class _FailingScaledLoss(nn.Module):
    """A loss with a learnable scale that fails on its third micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.calls = 0

    def forward(self, out: Tensor, target: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == 3:
            raise KeyError("fails on micro-batch 2")
        return nn.functional.mse_loss(out * self.scale, target)


@pytest.mark.parametrize("before", [None, 0.5])
def test_a_failed_step_puts_a_loss_modules_gradients_back(before: float | None) -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), chunks=4, schedule="1f1b")
    loss = _FailingScaledLoss()
    if before is not None:
        loss.scale.grad = torch.tensor(before)
    with pytest.raises(KeyError):
        pipe.train_step(torch.randn(8, 4), torch.randn(8, 2), loss)
    if before is None:
        assert loss.scale.grad is None
    else:
        torch.testing.assert_close(loss.scale.grad, torch.tensor(before))
    assert all(p.grad is None for p in pipe.parameters())


class _Detach(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.detach()


class _Both(nn.Module):
    """Its output, and a copy of it that carries no gradient."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x.detach() * 2


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphed"])
def test_a_loss_that_carries_no_gradient_is_refused_and_a_partly_detached_output_trains(
    graphs: bool,
) -> None:
    from mpstream.runtime.graphed import Emulated

    def pipe_of(last: nn.Module) -> tuple[Pipe, nn.Module]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2), last).double()
        plain = copy.deepcopy(model)
        pipe = Pipe(
            model, chunks=3, balance=[1, 2], devices=["cpu", "cpu"],
            graphs=Emulated() if graphs else False,
        )  # fmt: skip
        return pipe, plain

    x, y = data()
    pipe, _ = pipe_of(_Detach())
    for _ in range(2):  # the call that captures, and one that replays
        with pytest.raises(RuntimeError, match="loss_fn returned a loss that does not require"):
            pipe.train_step(x, y, nn.MSELoss())
        assert all(p.grad is None for p in pipe.parameters())

    def loss_fn(out: tuple[Tensor, Tensor], target: Tensor) -> Tensor:
        return ((out[0] - target) ** 2).mean() + (out[1] * out[0]).mean()

    pipe, plain = pipe_of(_Both())
    for _ in range(2):
        pipe.zero_grad()
        pipe.train_step(x, y, loss_fn)
    loss_fn(plain(x), y).backward()
    assert_same_grads(pipe, plain)


class Gated(nn.Module):
    """A module torch.fx traces, taking two inputs by name."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4).double()
        self.b = nn.Linear(4, 2).double()

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)) * gate)


def test_a_batch_spread_into_keywords_is_refused_with_what_to_do() -> None:
    model = Gated()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=4, split_points=["b"], devices=["cpu", "cpu"])
    x, y = data()
    batch = {"x": x, "gate": torch.rand(BATCH, 4, dtype=torch.float64)}
    with pytest.raises(
        TypeError, match=r"Pipe.train_step got keyword argument\(s\) 'x', 'gate', .* one dict"
    ):
        pipe.train_step(**batch)  # type: ignore[arg-type]
    # With the batch given, a keyword it does not take is an option misspelt,
    # not a batch spread: the message said to pass the batch as one dict.
    with pytest.raises(TypeError, match=r"keyword argument\(s\) 'reduciton'") as info:
        pipe.train_step(batch, y, nn.MSELoss(), reduciton="sum")  # type: ignore[call-arg]
    assert "did you mean 'reduction'?" in str(info.value)
    assert "spread" not in str(info.value)
    with pytest.raises(TypeError, match=r"'x', 'gate', .* one dict"):
        pipe.train_step(target=y, **batch)  # type: ignore[arg-type]
    # A model input beside the batch is no misspelt option: it goes into the
    # batch (the message listed the step's options alone).
    with pytest.raises(TypeError, match=r"'gate', which it does not take.* one dict") as info:
        pipe.train_step(x, y, nn.MSELoss(), gate=batch["gate"])  # type: ignore[call-arg]
    assert "did you mean" not in str(info.value)
    assert all(p.grad is None for p in pipe.parameters())  # refused before anything ran
    loss = pipe.train_step(batch, y, nn.MSELoss())  # the batch as one dict
    expected = nn.functional.mse_loss(ref(**batch), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)


def test_a_failed_step_puts_the_statistics_back_though_the_graphs_restore_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The two restores of a failed step are independent: the graphed
    # stages' raising (a sticky device error) used to skip the snapshot's,
    # leaving the failed step's BatchNorm statistics and gradients behind.
    from mpstream.runtime.graphed import Emulated

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)).double()
    pipe = Pipe(model, chunks=3, balance=[2, 1], devices=["cpu", "cpu"], graphs=Emulated())
    x, y = data()
    pipe.train_step(x, y, nn.MSELoss())  # captures
    grads = [p.grad.clone() for p in pipe.parameters() if p.grad is not None]
    stats = [b.clone() for b in pipe.buffers()]
    graphs = pipe._rt().worker.graphs
    assert graphs is not None

    def broken(keep: bool) -> None:
        raise RuntimeError("a sticky device error")

    monkeypatch.setattr(graphs, "restore", broken)

    def failing(out: Tensor, target: Tensor) -> Tensor:
        raise ValueError("the loss failed")

    with pytest.raises(ValueError, match="the loss failed") as info:
        pipe.train_step(x, y, failing)
    assert "restoring the state raised too" in "".join(getattr(info.value, "__notes__", []))
    for before, b in zip(stats, pipe.buffers(), strict=True):
        torch.testing.assert_close(b, before, rtol=0, atol=0)
    now = [p.grad for p in pipe.parameters() if p.grad is not None]
    for before, g in zip(grads, now, strict=True):
        torch.testing.assert_close(g, before, rtol=0, atol=0)

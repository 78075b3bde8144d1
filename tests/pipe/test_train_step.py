"""Pipe.train_step: gradients equal the whole-batch loss's, for both
schedules, every checkpoint mode and uneven micro-batches; 1F1B bounds the
activations alive per stage; failures leave nothing half-done."""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from mpstream import NoChunk, Pipe, verify_plan
from mpstream.memory import SavedTensorTracker
from mpstream.runtime import training
from mpstream.runtime.microbatch import scatter
from mpstream.runtime.plan import Plan
from mpstream.runtime.scheduler import EventScheduler
from mpstream.runtime.worker import Worker
from mpstream.schedules.schedule import Schedule
from tests.helpers import assert_same_grads, fits, mlp, virtual_for

BATCH = 10
SCHEDULES = ["gpipe", "1f1b"]
# The schedules of several stages per rank (tests/schedules covers them all):
# on the CPU every stage shares one device, so virtual_stages gives the ranks.
RANKED = ["looped_bfs", "interleaved_zb", "zbv", "dualpipev"]
MODES = ["never", "except_last", "always"]
SHAPES = [(2, 1), (3, 3), (4, 7), (3, BATCH), (2, 25)]


def reference_step(
    model: nn.Module, x: Tensor, y: Tensor, loss_fn: Callable[..., Tensor]
) -> Tensor:
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize(
    ("schedule", "stages", "split_size"),
    [(n, *shape) for n in SCHEDULES + RANKED for shape in SHAPES if fits(n, shape[0])],
)
@pytest.mark.parametrize("checkpoint", MODES)
def test_gradients_equal_the_whole_batch(
    schedule: str, checkpoint: str, stages: int, split_size: int
) -> None:
    model = mlp([5, 8, 7, 6, 4])
    ref = copy.deepcopy(model)
    balance = {2: [4, 4], 3: [2, 3, 3], 4: [2, 2, 2, 2]}[stages]
    pipe = Pipe(
        model,
        split_size=split_size,
        balance=balance,
        devices=["cpu"] * stages,
        schedule=schedule,
        checkpoint=checkpoint,
        virtual_stages=virtual_for(schedule, stages),
    )
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 4, dtype=torch.float64)
    loss = pipe.train_step(x, y, nn.MSELoss())
    expected = reference_step(ref, x, y, nn.MSELoss())
    torch.testing.assert_close(loss, expected)
    assert not loss.requires_grad
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_sum_reduction(schedule: str) -> None:
    model = mlp([5, 6, 3])
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=3, balance=[2, 2], devices=["cpu", "cpu"], schedule=schedule)
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 3, dtype=torch.float64)
    loss_fn = nn.MSELoss(reduction="sum")
    loss = pipe.train_step(x, y, loss_fn, reduction="sum")
    torch.testing.assert_close(loss, reference_step(ref, x, y, loss_fn))
    assert_same_grads(pipe, ref)


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3).double()
        self.b = nn.Linear(4, 2).double()

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.a(x), self.b(x)


def test_tuple_outputs_and_targets() -> None:
    model = nn.Sequential(nn.Linear(5, 4).double(), nn.Tanh(), TwoHeads())
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=4, balance=[2, 1], devices=["cpu", "cpu"], schedule="1f1b")

    def loss_fn(out: tuple[Tensor, Tensor], target: tuple[Tensor, Tensor]) -> Tensor:
        return nn.functional.mse_loss(out[0], target[0]) + nn.functional.mse_loss(out[1], target[1])

    x = torch.randn(BATCH, 5, dtype=torch.float64)
    y = (torch.randn(BATCH, 3, dtype=torch.float64), torch.randn(BATCH, 2, dtype=torch.float64))
    loss = pipe.train_step(x, y, loss_fn)
    torch.testing.assert_close(loss, reference_step(ref, x, y, loss_fn))
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stage_may_start_with_an_in_place_op(schedule: str) -> None:
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(inplace=True), nn.Linear(6, 3)).double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=3, balance=[1, 2], devices=["cpu", "cpu"], schedule=schedule)
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 3, dtype=torch.float64)
    loss = pipe.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(loss, reference_step(ref, x, y, nn.MSELoss()))
    assert_same_grads(pipe, ref)


def test_consecutive_steps_accumulate_and_optimizers_work() -> None:
    model = mlp([5, 6, 3])
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=3, balance=[2, 2], devices=["cpu", "cpu"], schedule="1f1b")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x, y = (
            torch.randn(BATCH, 5, dtype=torch.float64),
            torch.randn(BATCH, 3, dtype=torch.float64),
        )
        opt.zero_grad()
        opt_ref.zero_grad()
        pipe.train_step(x, y, nn.MSELoss())
        pipe.train_step(x, y, nn.MSELoss())  # accumulates: twice the gradient
        reference_step(ref, x, y, nn.MSELoss())
        reference_step(ref, x, y, nn.MSELoss())
        opt.step()
        opt_ref.step()
    for a, b in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


def test_plain_backward_still_works_with_a_1f1b_pipe() -> None:
    model = mlp([5, 6, 3])
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=3, balance=[2, 2], devices=["cpu", "cpu"], schedule="1f1b")
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 3, dtype=torch.float64)
    nn.MSELoss()(pipe(x), y).backward()
    reference_step(ref, x, y, nn.MSELoss())
    assert_same_grads(pipe, ref)


class Token:
    """Counts live activations of one stage: alive while its graph node is."""

    live: dict[int, int] = {}
    peak: dict[int, int] = {}

    def __init__(self, stage: int) -> None:
        self.stage = stage
        Token.live[stage] = Token.live.get(stage, 0) + 1
        Token.peak[stage] = max(Token.peak.get(stage, 0), Token.live[stage])

    def __del__(self) -> None:
        Token.live[self.stage] -= 1


class Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, stage: int, x: Tensor) -> Tensor:
        ctx.token = Token(stage)  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, g: Tensor) -> tuple[None, Tensor]:
        return None, g


class Probed(nn.Module):
    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage
        self.lin = nn.Linear(4, 4).double()

    def forward(self, x: Tensor) -> Tensor:
        return Probe.apply(self.stage, torch.tanh(self.lin(x)))


@pytest.mark.parametrize(("stages", "micros"), [(2, 8), (3, 8), (4, 8), (4, 2), (5, 12)])
def test_1f1b_bounds_live_activations_per_stage(stages: int, micros: int) -> None:
    for schedule in SCHEDULES:
        Token.live.clear()
        Token.peak.clear()
        pipe = Pipe(
            nn.Sequential(*[Probed(s) for s in range(stages)]), chunks=micros, schedule=schedule
        )
        pipe.train_step(
            torch.randn(micros, 4, dtype=torch.float64),
            torch.randn(micros, 4, dtype=torch.float64),
            nn.MSELoss(),
        )
        assert all(v == 0 for v in Token.live.values()), "activations outlived the step"
        if schedule == "gpipe":
            assert Token.peak == dict.fromkeys(range(stages), micros)
        else:
            for s in range(stages):
                assert Token.peak[s] <= min(stages - s, micros), (s, Token.peak)


def test_1f1b_saves_fewer_bytes_than_gpipe() -> None:
    peaks = {}
    for schedule in SCHEDULES:
        model = mlp([32, 64, 64, 64, 32])
        pipe = Pipe(model, chunks=8, balance=[2, 2, 2, 2], devices=["cpu"] * 4, schedule=schedule)
        x, y = torch.randn(64, 32, dtype=torch.float64), torch.randn(64, 32, dtype=torch.float64)
        with SavedTensorTracker() as tracker:
            pipe.train_step(x, y, nn.MSELoss())
        assert tracker.current_bytes == 0
        peaks[schedule] = tracker.peak_bytes
    assert peaks["1f1b"] < 0.75 * peaks["gpipe"], peaks


def test_train_step_plan_with_forced_copies_is_valid() -> None:
    """Copy and gradient-copy tasks of a training run, planned and checked."""
    model = mlp([4, 5, 6, 3])
    ref = copy.deepcopy(model)
    parts = [model[0:2], model[2:4], model[4:6]]
    sched = EventScheduler([torch.device("cpu")] * 3)
    worker = Worker(parts, sched)
    x, y = torch.randn(BATCH, 4, dtype=torch.float64), torch.randn(BATCH, 3, dtype=torch.float64)
    micro, targets = scatter(x, None, 3), scatter(y, None, 3)
    for name in SCHEDULES:
        model.zero_grad()
        schedule = Schedule(name, 3, len(micro), [True, True, True], backward=True)
        sched.recording = True
        sched.clear_plan()
        weights = [len(m) / BATCH for m in micro]  # type: ignore[arg-type]
        batches = [(b,) for b in micro]
        loss = training.run(worker, batches, targets, schedule, nn.MSELoss(), weights)
        verify_plan(Plan(sched.plan(), sched.slot_names, sched.slot_devices, 3))
        kinds = {op.kind for op in sched.plan() if op.op == "run"}
        assert kinds == {"forward", "backward", "copy", "copy_grad"}
        ref.zero_grad()
        expected = reference_step(ref, x, y, nn.MSELoss())
        torch.testing.assert_close(loss, expected)
        assert_same_grads(model, ref)


class MaskFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, mask: Tensor, x: Tensor) -> Tensor:
        return self.b(self.a(x) * mask)  # type: ignore[no-any-return]


def test_nochunk_tensors_do_not_size_the_micro_batches() -> None:
    # A NoChunk first among the inputs or the target (16 values, a batch of
    # 10): the micro-batches' sizes and loss weights come from split tensors.
    torch.manual_seed(0)
    model = MaskFirst().double()
    pipe = Pipe(copy.deepcopy(model), chunks=3, split_points=["b"], devices=["cpu"] * 2)
    x, mask = torch.randn(10, 8, dtype=torch.float64), torch.rand(16, dtype=torch.float64)
    cls, weight = torch.randint(0, 4, (10,)), torch.rand(4, dtype=torch.float64)
    mask.requires_grad_()

    def loss_fn(out: Tensor, target: tuple[Tensor, Tensor]) -> Tensor:
        return nn.functional.cross_entropy(out, target[1], weight=target[0], reduction="sum")

    loss = pipe.train_step((NoChunk(mask), x), (NoChunk(weight), cls), loss_fn, reduction="sum")
    expected = loss_fn(model(mask.detach(), x), (weight, cls))
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, model)
    assert mask.grad is None  # inputs are detached, NoChunk ones too


def test_the_step_follows_a_loss_modules_own_reduction() -> None:
    torch.manual_seed(0)
    model = mlp([4, 8, 2])
    pipe = Pipe(copy.deepcopy(model), chunks=4, balance=[2, 2], devices=["cpu"] * 2)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    summed = nn.MSELoss(reduction="sum")
    loss = pipe.train_step(x, y, summed)  # no reduction given: the loss's own
    expected = summed(model(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, model)
    with pytest.raises(ValueError, match="reduction='mean', but loss_fn reduces with 'sum'"):
        pipe.train_step(x, y, summed, reduction="mean")


COUNTED = {
    "ignored": lambda w: nn.CrossEntropyLoss(ignore_index=0),
    "class weights": lambda w: nn.CrossEntropyLoss(weight=w),
    "both, smoothed": lambda w: nn.CrossEntropyLoss(weight=w, ignore_index=0, label_smoothing=0.2),
    "nll": lambda w: nn.NLLLoss(weight=w, ignore_index=1),
}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("loss", list(COUNTED))
def test_a_mean_over_counted_targets_is_the_whole_batchs(schedule: str, loss: str) -> None:
    # Their mean divides by the targets kept (weighted by class): micro-batch
    # means weighted by share would not give the batch's mean. The first
    # micro-batch keeps none (a mean of its own would be 0/0).
    torch.manual_seed(0)
    model = mlp([4, 8, 3])
    pipe = Pipe(copy.deepcopy(model), chunks=3, balance=[2, 2], devices=["cpu"] * 2)
    pipe.schedule = schedule
    loss_fn = COUNTED[loss](torch.rand(3, dtype=torch.float64))
    x = torch.randn(BATCH, 4, dtype=torch.float64)
    y = torch.tensor([0, 0, 0, 0, 1, 2, 2, 1, 0, 2] if loss != "nll" else [1] * 4 + [0, 2] * 3)
    out = pipe.train_step(x, y, loss_fn)
    expected = reference_step(model, x, y, loss_fn)
    torch.testing.assert_close(out, expected)
    assert_same_grads(pipe, model)


Pair = collections.namedtuple("Pair", "x y")


class ReadsAPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4).double()
        self.b = nn.Linear(4, 3).double()

    def forward(self, batch: Pair) -> Tensor:
        return self.b(torch.tanh(self.a(batch.x)) + batch.y)


def test_a_namedtuple_batch_is_one_input_as_in_a_call() -> None:
    model = ReadsAPair()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=4, split_points=["b"], devices=["cpu", "cpu"])
    batch = Pair(
        torch.randn(BATCH, 4, dtype=torch.float64), torch.randn(BATCH, 4, dtype=torch.float64)
    )
    y = torch.randn(BATCH, 3, dtype=torch.float64)
    loss = pipe.train_step(batch, y, nn.functional.mse_loss)
    torch.testing.assert_close(loss, reference_step(ref, batch, y, nn.functional.mse_loss))
    assert_same_grads(pipe, ref)

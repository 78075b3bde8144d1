"""A forward run's tasks, with copy tasks forced on CPU so Copy and the
gradient copies run (and are planned) exactly as across devices."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.runtime import forward
from mpstream.runtime.gathering import gather
from mpstream.runtime.graphed import Emulated
from mpstream.runtime.microbatch import scatter
from mpstream.runtime.plan import Plan, PlanError, verify_plan
from mpstream.runtime.scheduler import EventScheduler
from mpstream.runtime.worker import Worker
from mpstream.schedules.schedule import Schedule
from tests.helpers import mlp


def build(stages: int, micros: int) -> tuple[Worker, Schedule, list[nn.Module]]:
    model = mlp([6] * (stages + 1))
    parts = [model[2 * s : 2 * s + 2] for s in range(stages)]
    sched = EventScheduler([torch.device("cpu")] * stages)
    schedule = Schedule("gpipe", stages, micros, [True] * stages)
    return Worker(parts, sched), schedule, [model]


@pytest.mark.parametrize("autograd_orders", [True, False])
@pytest.mark.parametrize(("stages", "split"), [(2, 3), (3, 2), (4, 5)])
def test_forced_copies_match_and_plan_forward_and_backward(
    stages: int, split: int, autograd_orders: bool
) -> None:
    """Both ways of ordering a gradient copy's consumer give a valid plan:
    autograd's own wait (torch >= 2.8) or the scheduler's."""
    worker, _, (model,) = build(stages, 1)
    worker.sched.native.autograd_orders_grad_copies = autograd_orders
    x = torch.randn(10, 6, dtype=torch.float64, requires_grad=True)
    micro = scatter(x, None, split)
    schedule = Schedule("gpipe", stages, len(micro), [True] * stages)
    worker.sched.recording = True
    out = gather(forward.run(worker, [(b,) for b in micro], schedule))
    out.pow(2).sum().backward()

    x_ref = x.detach().clone().requires_grad_()
    ref = model(x_ref)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref.pow(2).sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad)

    plan = Plan(worker.sched.plan(), worker.sched.slot_names, worker.sched.slot_devices, stages)
    verify_plan(plan)
    grad_copies = {
        (op.stage, op.micro) for op in plan.ops if op.kind == "copy_grad" and op.op == "run"
    }
    assert grad_copies == {(s, m) for s in range(stages - 1) for m in range(len(micro))}
    orderings = [i for i, op in enumerate(plan.ops) if op.kind == "copy_grad" and op.slot % 2 == 0]
    assert orderings and {plan.ops[i].op for i in orderings} == {
        "autograd" if autograd_orders else "wait"
    }
    for i in orderings:  # each is needed
        broken = Plan(plan.ops[:i] + plan.ops[i + 1 :], *plan_meta(plan))
        with pytest.raises(PlanError, match="compute stream never waits"):
            verify_plan(broken)


def plan_meta(plan: Plan) -> tuple[list[str], list[torch.device], int]:
    return plan.slot_names, plan.slot_devices, plan.stages


def test_non_float_tensors_cross_without_gradients() -> None:
    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(
            self, xs: tuple[torch.Tensor, torch.Tensor]
        ) -> tuple[torch.Tensor, torch.Tensor]:
            x, index = xs
            return self.lin(x) + index.unsqueeze(1).float(), index

    parts = [Stage(), Stage()]
    worker = Worker(parts, EventScheduler([torch.device("cpu")] * 2))
    x = (torch.randn(6, 4), torch.arange(6))
    micro = scatter(x, 3, None)
    batches = [(b,) for b in micro]
    out = gather(forward.run(worker, batches, Schedule("gpipe", 2, len(micro), [True, True])))
    assert isinstance(out, tuple)
    assert not out[1].requires_grad and out[1].dtype == torch.int64
    torch.testing.assert_close(out[1], x[1])
    out[0].sum().backward()
    assert all(p.grad is not None for s in parts for p in s.parameters())


def test_profiler_sees_stage_and_copy_ranges() -> None:
    worker, _, _ = build(2, 1)
    micro = scatter(torch.randn(4, 6, dtype=torch.float64), 2, None)
    schedule = Schedule("gpipe", 2, 2, [True, True])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        forward.run(worker, [(b,) for b in micro], schedule)
    names = {e.name for e in prof.events()}
    assert {"mpstream/forward/stage0/mb0", "mpstream/forward/stage1/mb1"} <= names
    assert "mpstream/copy/stage0/mb1" in names and "mpstream/copy/stage-1/mb0" in names


def test_the_hot_path_never_reads_a_tensor_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, reading a tensor's value on the host (item(), float(),
    bool(), ...) synchronizes with the device. Nothing in a pipelined
    forward, backward or train_step may do it; on the CPU such a read is
    caught by making it raise."""
    from mpstream import Pipe

    def no_host_read(self: torch.Tensor, *args: object) -> object:
        raise AssertionError("a tensor was read on the host")

    model = nn.Sequential(
        nn.Linear(6, 6),
        nn.BatchNorm1d(6, momentum=None),
        nn.Tanh(),
        nn.Linear(6, 6),
        nn.BatchNorm1d(6),
        nn.Linear(6, 2),
    ).double()
    pipes = [
        Pipe(
            copy.deepcopy(model),
            split_size=3,
            balance=[3, 3],
            devices=["cpu"] * 2,
            schedule=schedule,
            checkpoint=checkpoint,
            deferred_batch_norm=True,
            force_copies=True,
        )
        for schedule in ("gpipe", "1f1b")
        for checkpoint in ("never", "always")
    ]
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, no_host_read)
    for pipe in pipes:
        pipe(x.requires_grad_()).pow(2).mean().backward()
        pipe.train_step(x, y, nn.MSELoss())


@pytest.mark.parametrize("graphed", [False, True])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_frozen_model_s_output_requires_grad_as_the_plain_model_s(
    stages: int, graphed: bool
) -> None:
    # Only through an input that requires grad; its gradient comes back.
    model = mlp([5, 8, 7, 6, 4]).requires_grad_(False)
    balance = {1: [8], 2: [4, 4], 3: [2, 3, 3]}[stages]
    pipe = Pipe(copy.deepcopy(model), chunks=2, balance=balance, devices=["cpu"] * stages,
                graphs=Emulated() if graphed else False)  # fmt: skip
    x = torch.randn(6, 5, dtype=torch.float64)
    for _ in range(2):  # graphed: captured, then replayed
        assert not pipe(x).requires_grad and not model(x).requires_grad
        mine, plain = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = pipe(mine)
        assert out.requires_grad
        out.square().sum().backward()
        model(plain).square().sum().backward()
        torch.testing.assert_close(mine.grad, plain.grad)

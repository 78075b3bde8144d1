"""Copy tasks (send_hop): a hop's values of one micro-batch sent to the
peer's device, kept for the stages there; inside autograd only when the run
records gradients; the inputs never force-copied."""

from __future__ import annotations

import pytest
import torch

from mpstream.runtime.graph import Routes, StageGraph
from mpstream.runtime.hops import send_hop
from mpstream.runtime.scheduler import EventScheduler
from mpstream.runtime.values import Flow, Wiring
from mpstream.schedules.schedule import Kind, Schedule

CPU = torch.device("cpu")


def setup(force: bool) -> tuple[EventScheduler, Schedule, Routes, Flow, torch.Tensor]:
    sched = EventScheduler([CPU, CPU])
    schedule = Schedule("gpipe", 2, 1, [force, force])
    topology = schedule.topology
    routes = Routes(StageGraph.chain(2), topology.devices, topology.input_device, force)
    x = torch.randn(3, 2, requires_grad=True)
    flow = Flow(Wiring(routes), [(x,)])
    return sched, schedule, routes, flow, x


@pytest.mark.parametrize("grad", [True, False])
def test_a_copy_task_sends_and_keeps_the_values(grad: bool) -> None:
    sched, schedule, routes, flow, x = setup(force=True)
    stage0 = torch.nn.Linear(2, 2)
    copied: dict[int, torch.Tensor] = {}
    sched.native.begin_run(schedule.native, sched.caller_streams())
    try:
        for task in schedule.tasks:
            handle = sched.native.begin(task.index)
            with torch.set_grad_enabled(grad):
                if task.kind is Kind.FORWARD and task.stage == 0:
                    (arg,) = flow.values(0, 0)
                    copied[-1] = arg
                    flow.keep(0, 0, stage0(arg))
                elif task.kind is Kind.COPY:
                    hop = routes.by_task[(task.stage, task.peer)]
                    send_hop(flow, hop, sched, task, None, force=True, grad=grad)
                    if task.stage == 0:
                        (copied[0],) = flow.values(1, 0)
            sched.native.end(handle)
        sched.native.join()
    except BaseException:
        sched.abort()
        raise
    # The input hop is never forced: stage 0 reads the caller's tensor.
    assert copied[-1].data_ptr() == x.data_ptr()
    # Between stages it is (a copy even on one device), and inside autograd
    # only when the run records gradients.
    moved = copied[0]
    torch.testing.assert_close(moved, stage0(x))
    assert moved.requires_grad == grad
    if grad:
        assert type(moved.grad_fn).__name__ == "CopyBackward"
        moved.sum().backward()
        assert x.grad is not None and stage0.weight.grad is not None


class _DeadBranch(torch.nn.Module):
    """Stage 0 makes ``d``, which stage 1 reads into a value nothing uses."""

    def __init__(self) -> None:
        super().__init__()
        self.dead = torch.nn.Linear(2, 2)
        self.live = torch.nn.Linear(2, 2)
        self.unused = torch.nn.Linear(2, 2)
        self.out = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.dead(x)
        h = self.live(x)
        self.unused(d)
        return self.out(h)


def test_a_hook_on_a_parameter_no_gradient_reaches_is_not_called() -> None:
    from mpstream import Pipe

    torch.manual_seed(0)
    pipe = Pipe(
        _DeadBranch(), chunks=1, split_points=["unused"], devices=[CPU, CPU], force_copies=True
    )
    seen: list[torch.Tensor | None] = []
    pipe.dead.bias.register_hook(seen.append)  # type: ignore[union-attr]
    pipe(torch.randn(2, 2)).sum().backward()
    assert seen == []  # the plain model's backward never reaches self.dead
    assert pipe.dead.bias.grad is None  # type: ignore[union-attr]


class _Leaves(torch.nn.Module):
    """Hands on one hop of every kind of leaf: a tensor, the same tensor
    object again, a view of it, an integer tensor and a detached one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(2, 2, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.a(x)
        return h, h, h[:, :1], (x > 0).long(), h.detach() * 2


class _ReadLeaves(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = torch.nn.Linear(2, 2, dtype=torch.float64)

    def forward(self, v: tuple[torch.Tensor, ...]) -> torch.Tensor:
        h, again, column, signs, constant = v
        return self.b(h) * again + column * signs + constant


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_every_leaf_of_a_hop_crosses_as_in_the_plain_model(checkpoint: str) -> None:
    # A Copy per tensor: the same object twice (both reached), a view, an
    # integer and a constant; two backward passes over one forward.
    import copy

    from mpstream import Pipe

    torch.manual_seed(0)
    model = torch.nn.Sequential(_Leaves(), _ReadLeaves())
    pipe = Pipe(
        copy.deepcopy(model),
        chunks=2,
        devices=[CPU, CPU],
        force_copies=True,
        checkpoint=checkpoint,
    )
    x = torch.randn(4, 2, dtype=torch.float64)
    x_pipe, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_pipe, out_ref = pipe(x_pipe), model(x_ref)
    torch.testing.assert_close(out_pipe, out_ref)
    for out in (out_pipe, out_ref):
        out.pow(2).sum().backward(retain_graph=True)
        out.sum().backward()
    torch.testing.assert_close(x_pipe.grad, x_ref.grad)
    for (name, p), q in zip(pipe.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)

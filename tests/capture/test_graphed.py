"""CapturedStep over a pipe whose stages replay graphs of their own
(``Pipe(graphs=True)``): each call replays the stages' graphs through
``train_step``, between the zeroing and the optimizer's update captured
per device. Equal to plain training on the CPU (emulated stage graphs, the
step eager) and on one GPU; a failed capture leaves torch and the pipe
working."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from mpstream import CapturedStep, Pipe
from mpstream.capture import step as step_py
from mpstream.capture.devices import DeviceGraphs
from mpstream.runtime.graphed import Backend, Emulated
from tests.capture.fakes import D0, D1, World
from tests.capture.steps import HostSyncSGD, assert_trains_like
from tests.helpers import assert_same_grads, mlp


def _pipes(device: str, schedule: str, graphs: bool | Backend) -> tuple[Pipe, nn.Module]:
    """Three stages of a float64 MLP over ``device``, and the model's copy."""
    torch.manual_seed(0)
    model = mlp([5, 8, 7, 6, 4]).to(device)
    ref = copy.deepcopy(model)
    pipe = Pipe(
        model, split_size=3, balance=[2, 2, 4], devices=[device] * 3, schedule=schedule,
        graphs=graphs,
    )  # fmt: skip
    return pipe, ref


def _batches(device: str, n: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(7, 5, generator=g, dtype=torch.float64).to(device),
            torch.randn(7, 4, generator=g, dtype=torch.float64).to(device),
        )
        for _ in range(n)
    ]


def _steps(
    device: str, schedule: str, graphs: bool | Backend, steps: int = 3, **kw: object
) -> CapturedStep:
    """Captured steps over graphed stages against plain training of a copy (SGD)."""
    pipe, ref = _pipes(device, schedule, graphs)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    data = _batches(device, steps + 1)
    step = CapturedStep(pipe, *data[0], nn.MSELoss(), optimizer=opt, **kw)  # type: ignore[arg-type]
    assert_trains_like(step, pipe, ref, ref_opt, data[1:])
    return step


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_captured_steps_over_emulated_stage_graphs_on_the_cpu_equal_plain_training(
    schedule: str,
) -> None:
    backend = Emulated()
    step = _steps("cpu", schedule, backend)
    assert step.graphed and not step.captured and step.launches == 0
    assert backend.replays > 0  # the stages did replay their graphs
    # The batch's buffers; the stages' own are their report's.
    assert step.static_bytes == 7 * (5 + 4) * 8
    assert all(s.static_bytes > 0 for s in step.pipe.graph_report().stages)


class Clones(TorchDispatchMode):
    """Counts the aten clones of tensors in the storages given."""

    def __init__(self, tensors: list[Tensor]) -> None:
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in tensors}
        self.clones = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket is torch.ops.aten.clone:
            self.clones += args[0].untyped_storage().data_ptr() in self.storages
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("graphs", [False, "emulated"])
def test_a_step_that_zeroes_copies_no_gradient_and_a_failure_puts_zeros_back(
    graphs: str | bool,
) -> None:
    # The zeroing ran just before train_step: its failure snapshot needs no
    # copy of the gradients (a gradient-sized clone per call), only zeros.
    pipe, ref = _pipes("cpu", "1f1b", Emulated() if graphs else False)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    data = _batches("cpu", 4)
    fail = [False]

    def loss_fn(out: Tensor, target: Tensor) -> Tensor:
        if fail[0] and out.shape[0] == 1:  # the last micro-batch, after backwards ran
            raise KeyError("loss failed")
        return nn.functional.mse_loss(out, target)

    step = CapturedStep(pipe, *data[0], loss_fn, optimizer=opt)
    step(*data[0])  # gradients exist from now on
    grads = [p.grad for p in pipe.parameters()]
    with Clones(grads) as seen:  # type: ignore[arg-type]
        step(*data[1])
    assert seen.clones == 0
    fail[0] = True
    with pytest.raises(KeyError, match="loss failed"):
        step(*data[2])
    for p, g in zip(pipe.parameters(), grads):
        assert p.grad is g and not g.any()  # the same tensors, zero as the step began
    fail[0] = False
    for x, y in data[:2]:  # what the pipe's steps did: the failed one left nothing
        ref_opt.zero_grad()
        nn.MSELoss()(ref(x), y).backward()
        ref_opt.step()
    assert_trains_like(step, pipe, ref, ref_opt, data[3:])


def test_over_graphed_stages_reserved_bytes_are_the_zeroing_and_update_graphs_pools(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pipe, _ = _pipes("cpu", "gpipe", Emulated())
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    step = CapturedStep(pipe, *_batches("cpu", 1)[0], nn.MSELoss(), optimizer=opt)
    assert step.reserved_bytes == 0  # the CPU: nothing captured
    # What a capture over two GPUs leaves around the stages' graphs (fakes).
    world = World()

    def zero() -> None:
        for d in (D0, D1):
            world.work(d, "zero")

    step._zero = DeviceGraphs(zero, [D0, D1], world.cuda())
    step._update = DeviceGraphs(lambda: world.work(D1, "update"), [D0, D1], world.cuda())
    held = {("pool", g.index): 1000 * 2**g.index for g in world.graphs}
    monkeypatch.setattr(step_py, "pool_bytes", lambda pool: held[pool])
    # Graph 2, the update's on D0, captured nothing and was let go.
    assert len(world.graphs) == 4
    assert step.reserved_bytes == 1000 + 2000 + 8000


def test_a_pool_is_refused_for_graphed_stages() -> None:
    pipe = Pipe(mlp([5, 8, 4]), split_size=3, balance=[1, 3], devices=["cpu"] * 2, graphs=True)
    x, y = torch.randn(6, 5), torch.randn(6, 4)
    with pytest.raises(ValueError, match="replay graphs of their own .graphs=True.*drop pool"):
        CapturedStep(pipe, x, y, nn.MSELoss(), pool=object())


@pytest.mark.cuda
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_captured_steps_over_graphed_stages_on_one_gpu_equal_plain_training(
    schedule: str,
) -> None:
    step = _steps("cuda:0", schedule, True)
    # Micro-batches of 3, 3 and 1, each replaying a forward and a backward
    # graph per stage (zb_h1: B and W, but no B for the first stage, whose
    # input needs no gradient); a zeroing and an update graph on the device.
    per_micro = 3 + 2 + 3 if schedule == "zb_h1" else 3 + 3
    assert step.captured and step.launches == 3 * per_micro + 2
    with pytest.raises(RuntimeError, match="no one pool to share"):
        _ = step.pool


@pytest.mark.cuda
def test_back_to_back_replays_without_a_host_sync_train_like_eager_steps() -> None:
    pipe, ref = _pipes("cuda:0", "1f1b", True)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    data = _batches("cuda:0", 30)
    step = CapturedStep(pipe, *data[0], nn.MSELoss(), optimizer=opt)
    losses = [step(x, y) for x, y in data]  # no host sync in between
    expected = []
    for x, y in data:
        ref_opt.zero_grad()
        loss = nn.MSELoss()(ref(x), y)
        loss.backward()
        ref_opt.step()
        expected.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected))
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())


@pytest.mark.cuda
def test_a_capture_of_the_update_that_fails_leaves_torch_and_the_pipe_working() -> None:
    torch.manual_seed(0)
    model = mlp([5, 8, 4]).cuda()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=3, balance=[1, 3], devices=["cuda:0"] * 2, graphs=True)
    # A host sync inside the update: its capture fails.
    opt = HostSyncSGD(pipe.parameters(), lr=0.01)
    x, y = torch.randn(6, 5, device="cuda"), torch.randn(6, 4, device="cuda")
    with pytest.raises(Exception) as info:
        CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt)
    assert any("capturing the step failed" in n for n in getattr(info.value, "__notes__", []))
    assert all(p.grad is None for p in pipe.parameters())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no capture left underway in the allocator
    nn.functional.dropout(torch.ones(4, device="cuda"), 0.5)  # the generator is out of capture
    loss = pipe.train_step(x, y, nn.MSELoss())  # the pipe still trains
    reference = nn.MSELoss()(ref(x), y)
    reference.backward()
    torch.testing.assert_close(loss, reference.detach())
    assert_same_grads(pipe, ref)

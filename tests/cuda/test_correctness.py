"""Results on GPUs equal the CPU model's: stages on one GPU and on two, input
from the host (one no loss reaches included), training steps, the tutorial's
ResNet50, a CPU stage before a CUDA one and after one.

Marked ``cuda``: skipped cleanly without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from tests.cuda.helpers import (
    BATCH,
    cycles_per_ms,
    run_and_compare,
    two_gpus,
)
from tests.helpers import mlp

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("split_size", [1, 3, 7, BATCH, 20])
def test_stages_on_one_gpu_match_cpu(stages: int, split_size: int) -> None:
    model = mlp([5, 8, 7, 6, 4])
    balance = {2: [4, 4], 3: [3, 3, 2], 4: [2, 2, 2, 2]}[stages]
    pipe = Pipe(
        copy.deepcopy(model), split_size=split_size, balance=balance, devices=["cuda:0"] * stages
    )
    run_and_compare(model, pipe, torch.randn(BATCH, 5, dtype=torch.float64, device="cuda:0"))


@pytest.mark.parametrize("force_copies", [False, True])
@pytest.mark.parametrize("pinned", [False, True])
def test_cpu_input_and_its_gradient_match_cpu(pinned: bool, force_copies: bool) -> None:
    model = mlp([5, 8, 4])
    pipe = Pipe(
        copy.deepcopy(model),
        chunks=3,
        balance=[2, 2],
        devices=["cuda:0", "cuda:0"],
        force_copies=force_copies,
    )
    x = torch.randn(BATCH, 5, dtype=torch.float64)
    run_and_compare(model, pipe, x.pin_memory() if pinned else x)


@two_gpus
@pytest.mark.parametrize("split_size", [1, 5, BATCH])
def test_two_gpus_match_cpu(split_size: int) -> None:
    model = mlp([5, 8, 7, 4])
    pipe = Pipe(
        copy.deepcopy(model), split_size=split_size, balance=[3, 3], devices=["cuda:0", "cuda:1"]
    )
    run_and_compare(model, pipe, torch.randn(BATCH, 5, dtype=torch.float64, device="cuda:0"))


@two_gpus
def test_tutorial_resnet50_on_two_gpus_matches_cpu() -> None:
    from mpstream.tutorial import StreamPipelineResNet50

    gpu = StreamPipelineResNet50("cuda:0", "cuda:1", split_size=3, num_classes=10).double().eval()
    cpu = StreamPipelineResNet50("cpu", "cpu", split_size=3, num_classes=10).double().eval()
    cpu.load_state_dict(gpu.state_dict())
    x = torch.randn(8, 3, 64, 64, dtype=torch.float64)
    torch.testing.assert_close(gpu(x.cuda()).cpu(), cpu(x))


def test_tutorial_resnet50_on_one_gpu_matches_cpu() -> None:
    from mpstream.tutorial import StreamPipelineResNet50

    gpu = StreamPipelineResNet50("cuda:0", "cuda:0", split_size=3, num_classes=10).double()
    cpu = StreamPipelineResNet50("cpu", "cpu", split_size=3, num_classes=10).double()
    cpu.load_state_dict(gpu.state_dict())
    x = torch.randn(8, 3, 64, 64, dtype=torch.float64)
    out_gpu, out_cpu = gpu(x.cuda()), cpu(x)
    torch.testing.assert_close(out_gpu.cpu(), out_cpu)
    out_gpu.sum().backward()
    out_cpu.sum().backward()
    grads = dict(cpu.named_parameters())
    for name, p in gpu.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), grads[name].grad, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("devices", ["one", "forced", "two"])
def test_train_step_on_gpus_matches_cpu(schedule: str, checkpoint: str, devices: str) -> None:
    if devices == "two" and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    layout = ["cuda:0", "cuda:1", "cuda:1"] if devices == "two" else ["cuda:0"] * 3
    model = mlp([5, 8, 7, 4])
    ref = copy.deepcopy(model)
    pipe = Pipe(
        copy.deepcopy(model),
        split_size=3,
        balance=[2, 2, 2],
        devices=layout,
        schedule=schedule,
        checkpoint=checkpoint,
        force_copies=devices == "forced",
    )
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 4, dtype=torch.float64)
    # Pinned input, pageable targets: both move in transfer tasks.
    loss = pipe.train_step(x.pin_memory(), y, nn.MSELoss())
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach())
    for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, msg=name)


@two_gpus
def test_stage_code_runs_with_its_device_current() -> None:
    seen: list[tuple[int, int, int]] = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: Tensor) -> Tensor:
            seen.append(
                (
                    x.device.index,
                    torch.cuda.current_device(),
                    torch.cuda.current_stream().device.index,
                )
            )
            return self.lin(x) + torch.ones(1, device="cuda")  # the current device's

    pipe = Pipe(
        nn.Sequential(Probe(), Probe()), balance=[1, 1], devices=["cuda:0", "cuda:1"], chunks=2
    )
    pipe(torch.ones(4, 2, device="cuda:0")).sum().backward()
    assert seen and all(d == current == stream for d, current, stream in seen)
    assert torch.cuda.current_device() == 0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_cpu_stage_then_cuda_stage_matches_cpu(schedule: str) -> None:
    """A CPU stage feeding a GPU stage: its pageable output moves through a
    pinned buffer; the gradient comes back with a blocking copy."""
    model = mlp([5, 8, 7, 4])
    ref = copy.deepcopy(model)
    pipe = Pipe(
        copy.deepcopy(model), split_size=3, balance=[2, 4], devices=["cpu", "cuda:0"],
        schedule=schedule,
    )  # fmt: skip
    run_and_compare(model, pipe, torch.randn(BATCH, 5, dtype=torch.float64))
    pipe.zero_grad()
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 4, dtype=torch.float64)
    loss = pipe.train_step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach())
    for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, msg=name)


def test_cuda_stage_then_cpu_stage_orders_the_gradient_s_copy_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU stage feeding a CPU stage, in the user's loop: the CPU stage's
    gradient goes back to the GPU on the GPU stage's copy stream from a Copy
    node autograd runs on the host, with no stream of its own (its forward
    output is on the host), where autograd orders the GPU stage's backward
    after the caller's current stream alone. The copy, held 20 ms on its
    stream, must still land before that backward reads it."""
    from mpstream.runtime import copy as copy_module

    real = copy_module.to_device
    hold = int(20 * cycles_per_ms())

    def late(x: Tensor, device: torch.device, staging: Tensor | None = None) -> Tensor:
        if device.type == "cuda" and not x.is_cuda:
            with torch.cuda.device(device):
                torch.cuda._sleep(hold)  # on the current stream: the copy's
        return real(x, device, staging)

    model = mlp([5, 8, 7, 4])
    pipe = Pipe(copy.deepcopy(model), chunks=2, balance=[2, 4], devices=["cuda:0", "cpu"])
    monkeypatch.setattr(copy_module, "to_device", late)
    # One call only: a second could find the right values left in the
    # gradient's new memory by the first.
    run_and_compare(model, pipe, torch.randn(BATCH, 5, dtype=torch.float64, device="cuda:0"))


def test_pageable_input_reuses_pinned_buffers_across_steps() -> None:
    """One pinned buffer per tensor per step, recycled by PyTorch's caching
    host allocator: no new cudaHostAlloc in the steady state."""
    pipe = Pipe(mlp([64, 64, 8]).float().cuda(), split_size=4, balance=[2, 2],
                devices=["cuda:0"] * 2)  # fmt: skip
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    for _ in range(3):
        pipe.train_step(x, y, nn.MSELoss())
        torch.cuda.synchronize()
    before = torch.cuda.host_memory_stats()["num_host_alloc"]
    for _ in range(10):
        pipe.train_step(x, y, nn.MSELoss())
        pipe(x).sum().backward()
        torch.cuda.synchronize()
    assert torch.cuda.host_memory_stats()["num_host_alloc"] == before


class _DeadInput(nn.Module):
    """Of two host inputs, ``y`` goes only into a value the next stage drops."""

    def __init__(self) -> None:
        super().__init__()
        self.dead, self.live, self.unused, self.out = (
            nn.Linear(2, 2, dtype=torch.float64) for _ in range(4)
        )

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        d = self.dead(y)
        h = self.live(x)
        self.unused(d)
        return self.out(h)


@pytest.mark.parametrize("pinned", [False, True])
def test_host_inputs_no_loss_reaches_get_no_hook_call(pinned: bool) -> None:
    # Each host input waits for its own gradient's copy back (a HostWait of
    # its own): the one no loss reaches has none, and no hook sees None.
    model = _DeadInput()
    pipe = Pipe(
        copy.deepcopy(model),
        chunks=3,
        split_points=["unused"],
        devices=["cuda:0", "cuda:0"],
        force_copies=True,
    )
    x, y = (torch.randn(BATCH, 2, dtype=torch.float64) for _ in range(2))
    xp, yp = ((t.pin_memory() if pinned else t.clone()).requires_grad_() for t in (x, y))
    calls: dict[str, list[bool]] = {"x": [], "y": [], "dead": []}
    xp.register_hook(lambda g: calls["x"].append(g is None))
    yp.register_hook(lambda g: calls["y"].append(g is None))
    pipe.get_parameter("dead.weight").register_hook(lambda g: calls["dead"].append(g is None))
    xr, yr = (t.detach().clone().requires_grad_() for t in (x, y))
    out, ref = pipe(xp, yp), model(xr, yr)
    torch.testing.assert_close(out.cpu(), ref)
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    assert calls == {"x": [False], "y": [], "dead": []}
    assert yp.grad is None and yr.grad is None
    torch.testing.assert_close(xp.grad, xr.grad)
    for name, p in model.named_parameters():
        got = pipe.get_parameter(name).grad
        assert (got is None) == (p.grad is None), name
        if got is not None:
            torch.testing.assert_close(got.cpu(), p.grad, msg=name)

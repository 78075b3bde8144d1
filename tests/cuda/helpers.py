"""What the CUDA tests share: comparison with the CPU model, calibrated GPU
sleeps, timing with CUDA events, a two-GPU marker."""

from __future__ import annotations

import statistics

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)


BATCH = 12


def run_and_compare(model: nn.Sequential, pipe: Pipe, x: Tensor) -> None:
    """Forward + backward on the pipe (input on ``x``'s device) and on the CPU model."""
    x_ref = x.detach().cpu().clone().requires_grad_()
    x_pipe = x.detach().clone()
    if x.is_pinned():
        x_pipe = x_pipe.pin_memory()  # clone() does not keep pinning
    x_pipe.requires_grad_()
    out = pipe(x_pipe)
    ref = model(x_ref)
    assert out.device == pipe.devices[-1]
    torch.testing.assert_close(out.cpu(), ref)
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    torch.testing.assert_close(x_pipe.grad.cpu(), x_ref.grad)
    for (name, a), b in zip(pipe.named_parameters(), model.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, msg=name)


class Sleep(nn.Module):
    """Spins the current stream for ``cycles`` GPU clock cycles."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.cycles = cycles

    def forward(self, x: Tensor) -> Tensor:
        torch.cuda._sleep(self.cycles)
        return x + 1


def cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    samples = []
    for _ in range(5):
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        samples.append(10_000_000 / start.elapsed_time(end))
    return statistics.median(samples)


def time_ms(fn: object, repeat: int = 5) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()  # type: ignore[operator]
    samples = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start.record()
        fn()  # type: ignore[operator]
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


class SleepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: Tensor, forward: int, backward: int) -> Tensor:  # type: ignore[override]
        torch.cuda._sleep(forward)
        ctx.backward = backward  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        torch.cuda._sleep(ctx.backward)  # type: ignore[attr-defined]
        return grad.clone(), None, None


class SleepStage(nn.Module):
    """``forward`` and ``backward`` cycles of GPU sleep per micro-batch."""

    def __init__(self, forward: int, backward: int) -> None:
        super().__init__()
        self.cycles = (forward, backward)
        self.w = nn.Parameter(torch.ones(1, device="cuda"))

    def forward(self, x: Tensor) -> Tensor:
        return SleepFn.apply(x * self.w, *self.cycles)  # type: ignore[no-any-return]


def norm_mlp() -> nn.Sequential:
    """Linear layers with BatchNorms, one of them a cumulative average."""
    return nn.Sequential(
        nn.Linear(16, 32), nn.BatchNorm1d(32, momentum=None), nn.Tanh(),
        nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 8),
    )  # fmt: skip

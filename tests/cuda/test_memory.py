"""Memory on GPUs: flat across steps, freed blocks not reused while another
stream reads them, the peak of each schedule per device.

Marked ``cuda``: skipped cleanly without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from tests.cuda.helpers import (
    cycles_per_ms,
)

pytestmark = pytest.mark.cuda


def test_memory_does_not_grow_across_steps() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(3)]).cuda()
    pipe = Pipe(model, split_size=4, balance=[1, 1, 1], devices=["cuda:0"] * 3)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    x = torch.randn(32, 256, device="cuda")

    def step() -> None:
        opt.zero_grad()
        pipe(x).pow(2).mean().backward()
        opt.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for _ in range(50):
        step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= baseline


@pytest.mark.parametrize("force_copies", [False, True])
@pytest.mark.parametrize("how", ["forward+backward", "train_step"])
def test_allocator_reuse_keeps_results_exact(force_copies: bool, how: str) -> None:
    """Stage 0 is fast and scribbles over fresh memory; stage 1 sleeps before
    it reads its input. A tensor freed by the host while another stream
    still has to read it, without record_stream, would be handed to stage 0's
    next allocation and overwritten: the results would differ."""
    cycles = int(cycles_per_ms() * 2.0)

    class Scribble(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64).double()

        def forward(self, x: Tensor) -> Tensor:
            junk = torch.full((x.shape[0], 64), float("nan"), dtype=x.dtype, device=x.device)
            del junk
            return self.lin(x) * 2 + 1

    class Late(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 8).double()

        def forward(self, x: Tensor) -> Tensor:
            torch.cuda._sleep(cycles)
            return self.lin(x)

    model = nn.Sequential(Scribble(), Late())
    ref = copy.deepcopy(model)
    pipe = Pipe(model.cuda(), split_size=2, devices=["cuda:0", "cuda:0"], force_copies=force_copies)
    x, y = torch.randn(16, 64, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)
    for _ in range(3):
        pipe.zero_grad()
        ref.zero_grad()
        if how == "train_step":
            loss = pipe.train_step(x, y, nn.MSELoss())
            expected = nn.MSELoss()(ref(x), y)
            expected.backward()
            torch.testing.assert_close(loss.cpu(), expected.detach())
        else:
            out = pipe(x.cuda())
            expected = ref(x)
            torch.testing.assert_close(out.cpu(), expected)
            out.pow(2).sum().backward()
            expected.pow(2).sum().backward()
        for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad.cpu(), b.grad, msg=name)


def test_peak_memory_per_device_by_schedule() -> None:
    """max_memory_allocated per device for each schedule on the same model:
    the schedules that bound live activations use less than fill-drain."""
    from mpstream.observe.compare import measure_memory

    devices = ["cuda:0", "cuda:1"] * 2 if torch.cuda.device_count() > 1 else ["cuda:0"] * 4
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(8)])
    pipe = Pipe(model, chunks=8, balance=[2, 2, 2, 2], devices=devices)
    x, y = torch.randn(256, 512), torch.randn(256, 512)
    virtual = None if devices[0] != devices[1] else 2
    peaks = measure_memory(pipe, x, y, nn.functional.mse_loss, virtual_stages=virtual)
    gpipe = sum(peaks["gpipe"].values())
    for name in ("1f1b", "interleaved_1f1b", "zb_h1"):
        assert sum(peaks[name].values()) < gpipe, peaks

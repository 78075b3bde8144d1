"""Plain training beside a CapturedStep: its optimizers, data, pipes, and the
comparison of the two (equal losses, then equal parameters), for the tests of
mpstream.capture on the CPU and on a GPU."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn

from mpstream import CapturedStep, Pipe
from tests.helpers import mlp

__all__ = [
    "BATCH",
    "OPTIMIZERS",
    "HostSyncSGD",
    "assert_trains_like",
    "check_steps",
    "data",
    "setup",
]

BATCH = 10
Opt = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Opt] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    # capturable: needed for capture on CUDA, refused for CPU parameters.
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, capturable=ps[0].is_cuda),
}


class HostSyncSGD(torch.optim.SGD):
    """SGD that reads a value on the host in its step, as no graph can."""

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        float(self.param_groups[0]["params"][0].detach().sum())
        super().step()


def data(device: str, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, 5, dtype=torch.float64, generator=g)
    y = torch.randn(BATCH, 4, dtype=torch.float64, generator=g)
    return x.to(device), y.to(device)


def setup(
    device: str, optimizer: str, **kw: object
) -> tuple[Pipe, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]:
    model = mlp([5, 8, 7, 4]).to(device)
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[2, 4], devices=[device, device], **kw)  # type: ignore[arg-type]
    make = OPTIMIZERS[optimizer]
    return pipe, make(list(pipe.parameters())), ref, make(list(ref.parameters()))


def check_steps(device: str, optimizer: str, steps: int = 3, **kw: object) -> CapturedStep:
    """Runs ``steps`` captured steps against plain training of a copy."""
    pipe, opt, ref, ref_opt = setup(device, optimizer, **kw)
    before = [p.detach().clone() for p in pipe.parameters()]
    step = CapturedStep(pipe, *data(device, 0), nn.MSELoss(), optimizer=opt)
    for p, b in zip(pipe.parameters(), before):  # capture changed nothing
        torch.testing.assert_close(p.detach(), b)
    assert_trains_like(step, pipe, ref, ref_opt, [data(device, i + 1) for i in range(steps)])
    return step


def assert_trains_like(
    step: CapturedStep,
    pipe: Pipe,
    ref: nn.Module,
    ref_opt: torch.optim.Optimizer,
    batches: list[tuple[Tensor, Tensor]],
) -> None:
    """Each batch through ``step`` and through plain training of ``ref``:
    equal losses, then equal parameters (MSE loss)."""
    for i, (x, y) in enumerate(batches):
        loss = step(x, y)
        ref_opt.zero_grad()
        expected = nn.MSELoss()(ref(x), y)
        expected.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, expected.detach(), msg=f"loss of step {i}")
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=f"parameter {name}")

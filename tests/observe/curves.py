"""Models and settings shared by the tuning tests (test_tuning.py, test_tune_cache.py):
a model whose step time is a chosen curve of its split size, read off a fake clock."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mpstream import Pipe

__all__ = ["CLOCK", "SAMPLE", "Curve", "LazyCurve", "small_pipe", "total"]

#: tune's clock in these tests (conftest.py's ``tune_clock`` puts it in): a
#: Curve's forward advances it, so the curve tune measures does not depend on
#: how busy the machine is.
CLOCK = [0.0]


class Curve(nn.Module):
    """A model whose step time is a U-shaped function of its split size."""

    def __init__(self, best: int = 6, step_ms: float = 4.0, floor_ms: float = 3.0) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.split_size = 1
        self.best = best
        self.step_ms = step_ms
        self.floor_ms = floor_ms
        self.calls: list[int] = []

    def forward(self, x: Tensor) -> Tensor:
        self.calls.append(self.split_size)
        CLOCK[0] += (self.floor_ms + self.step_ms * abs(self.split_size - self.best)) / 1e3
        return self.lin(x)


class LazyCurve(Curve):
    """A Curve whose first layer has no size until its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.LazyLinear(2)


SAMPLE = torch.randn(16, 2)


def total(out: Tensor) -> Tensor:
    """One loss for the runs that share a cache entry (the key names it)."""
    return out.sum()


def small_pipe(schedule: str = "1f1b", **kw: object) -> Pipe:
    """Two CPU stages of a small MLP, 2 micro-batches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2))
    return Pipe(model, chunks=2, balance=[2, 1], devices=["cpu"] * 2, schedule=schedule, **kw)

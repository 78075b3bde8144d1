"""An eager pipe and its graphed twin for the graphed-stage tests: the same
model and options twice, graphs emulated on the CPU unless given, and a
batch of the models' widths."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated

__all__ = ["CHECKPOINTS", "WIDTHS", "data", "pair"]

CHECKPOINTS = ["never", "except_last", "always"]
WIDTHS = [6, 12, 12, 8, 4]


def pair(model: nn.Module, graphs: object = None, **kwargs: object) -> tuple[Pipe, Pipe]:
    """The same pipe twice: eager, and graphed (emulated unless given)."""
    kwargs.setdefault("balance", [4, 4])
    kwargs.setdefault("devices", ["cpu", "cpu"])
    eager = Pipe(copy.deepcopy(model), **kwargs)  # type: ignore[arg-type]
    graphed = Pipe(copy.deepcopy(model), graphs=graphs or Emulated(), **kwargs)  # type: ignore[arg-type]
    return eager, graphed


def data(batch: int = 10) -> tuple[Tensor, Tensor]:
    """A float64 batch of ``batch`` inputs and targets of the widths' ends."""
    return torch.randn(batch, WIDTHS[0], dtype=torch.float64), torch.randn(
        batch, WIDTHS[-1], dtype=torch.float64
    )

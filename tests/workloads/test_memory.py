"""Memory per stage of a training step: a graphed stage's activations are
its graphs' pools and the static buffers they hold outside them."""

from __future__ import annotations

import torch
from torch import nn

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated
from mpstream.workloads import memory
from tests.helpers import mlp


def test_a_graphed_stage_s_activations_include_its_static_buffers() -> None:
    pipe = Pipe(mlp([6, 12, 4]), balance=[2, 2], devices=["cpu", "cpu"], split_size=5,
                graphs=Emulated())  # fmt: skip
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    x, y = torch.randn(10, 6, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)

    def step() -> None:
        optimizer.zero_grad()
        pipe.train_step(x, y, nn.MSELoss())
        optimizer.step()

    step()  # captures
    stages, _ = memory.per_stage(pipe, optimizer, step)
    report = pipe.graph_report().stages
    # The emulated backend has no pools: what is held is the static buffers.
    assert [s.reserved_bytes for s in report] == [0, 0]
    assert [s["activations"] for s in stages] == [s.static_bytes for s in report]
    assert all(s.static_bytes > 0 for s in report)

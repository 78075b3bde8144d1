"""Memory per stage of a training step: a graphed stage's activations are
its graphs' pools and the static buffers they hold outside them; a step
captured whole adds its static input and target buffers."""

from __future__ import annotations

import torch
from torch import nn

from mpstream import CapturedStep, Pipe
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


def test_a_step_captured_whole_adds_its_static_buffers_to_its_activations() -> None:
    pipe = Pipe(mlp([6, 12, 4]), balance=[4], devices=["cpu"], chunks=1)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    x, y = torch.randn(10, 6, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)
    whole = CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=optimizer)

    def step() -> None:
        whole(x, y)

    step()
    (eager,), _ = memory.per_stage(pipe, optimizer, step)
    (held,), _ = memory.per_stage(pipe, optimizer, step, static_bytes=whole.static_bytes)
    assert whole.static_bytes == 10 * (6 + 4) * 8
    # Run eagerly (the CPU): what it saved for backward, and the batch's buffers.
    assert eager["activations"] > 0
    assert held["activations"] == eager["activations"] + whole.static_bytes
    (graph,), _ = memory.per_stage(pipe, optimizer, step, graph_bytes=12345, static_bytes=800)
    assert graph["activations"] == 12345 + 800  # replayed: its pool, and the buffers

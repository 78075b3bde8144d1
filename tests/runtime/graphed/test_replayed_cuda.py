"""Replayed tasks on a GPU, around the hot path: no synchronizing call once
captured (training step and the user's loop, pinned host input), and an
eager last stage's loss reading a replayed stage's output while the
producer's next forward rewrites its slot (zero-bubble). Skipped without
CUDA; the CPU checks are in tests/runtime/test_replayed.py and
test_slot_order.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpstream.runtime.graphed import CudaGraphs
from tests.helpers import assert_same_grads, mlp
from tests.runtime.graphed.pairs import WIDTHS, data, pair
from tests.runtime.test_replayed import check_loss_weight_over_a_replayed_output


@pytest.mark.cuda
@pytest.mark.parametrize("force_copies", [False, True])
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_cuda_replayed_tasks_never_make_the_host_wait(schedule: str, force_copies: bool) -> None:
    """Once captured, a graphed pipe's training step and the user's loop
    (forward, backward, the gradient buffers attached again after
    ``zero_grad()``, the passes' ends) issue no synchronizing call from
    pinned host input: CUDA's sync debug mode raises on one, where a host
    stall would hold every task behind it."""
    eager, graphed = pair(
        mlp(WIDTHS), graphs=True, chunks=4, schedule=schedule, force_copies=force_copies,
        devices=["cuda:0", "cuda:0"],
    )  # fmt: skip
    x, y = (t.pin_memory() for t in data(16))
    y_gpu = y.cuda()

    def step() -> None:
        for pipe in (graphed, eager):
            pipe.zero_grad()
            pipe.train_step(x, y, nn.MSELoss())
            pipe.zero_grad()
            nn.functional.mse_loss(pipe(x), y_gpu).backward()

    for _ in range(2):  # capture, then the first replays
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert_same_grads(graphed, eager)
    assert all(s.graphed for s in graphed.graph_report().stages)


@pytest.mark.cuda
def test_cuda_an_eager_last_stage_s_loss_weight_sees_the_replayed_output_it_read() -> None:
    """Zero-bubble, stage 0 replayed, the last stage eager, a loss with a
    weight matrix over stage 0's output (part of the result): its gradient
    is a weight pass's, which runs after stage 0's next forward into the
    slot (host and stream order). Read in place, it used the next
    micro-batch's output: no version check sees a replay's writes."""
    check_loss_weight_over_a_replayed_output(CudaGraphs(), "cuda")

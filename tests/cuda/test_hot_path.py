"""The hot path issues no host synchronisation, for every schedule.

Marked ``cuda``: skipped cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpstream import Pipe
from tests.cuda.helpers import (
    norm_mlp,
)

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pinned", [True, False])
def test_no_host_synchronization_in_a_step(schedule: str, pinned: bool) -> None:
    """Forward, backward and train_step never make the host wait for the
    device: CUDA's sync debug mode raises on any synchronizing call."""
    pipe = Pipe(
        norm_mlp().cuda(),
        split_size=4,
        balance=[3, 3, 1],
        devices=["cuda:0"] * 3,
        schedule=schedule,
        checkpoint="except_last",
        deferred_batch_norm=True,
        force_copies=True,
    )
    x, y = torch.randn(16, 16), torch.randn(16, 8)
    if pinned:
        x, y = x.pin_memory(), y.pin_memory()

    def step() -> None:
        pipe(x).pow(2).mean().backward()
        pipe.train_step(x, y, nn.MSELoss())

    step()  # warm-up: allocator, cuBLAS handles, pinned blocks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zb_h1"])
def test_no_host_synchronization_in_new_schedules(schedule: str) -> None:
    pipe = Pipe(
        norm_mlp().cuda(),
        split_size=4,
        balance=[3, 3, 1],
        devices=["cuda:0"] * 3,
        schedule=schedule,
        virtual_stages=3 if schedule == "interleaved_1f1b" else None,
        deferred_batch_norm=True,
        force_copies=True,
    )
    x, y = torch.randn(16, 16).pin_memory(), torch.randn(16, 8).pin_memory()
    pipe.train_step(x, y, nn.MSELoss())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pipe.train_step(x, y, nn.MSELoss())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

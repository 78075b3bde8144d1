"""Interleaved 1F1B, zero-bubble H1 and user-given orders on GPUs equal the CPU
model, on one GPU, with forced copies and round-robin.

Marked ``cuda``: skipped cleanly without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.schedules import PLACEMENTS
from tests.cuda.helpers import (
    BATCH,
)
from tests.helpers import mlp

pytestmark = pytest.mark.cuda


def _user_order() -> str:
    from mpstream.schedules.schedule import Schedule

    order = str(Schedule("zb_h1", 4, 4, [False] * 4)).split()
    return " ".join([a for a in order if a[0] != "W"] + [a for a in order if a[0] == "W"])


NAMES = ["interleaved_1f1b", "zb_h1", "looped_bfs", "interleaved_zb", "zbv", "dualpipev", "custom"]


@pytest.mark.parametrize("schedule", NAMES)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("devices", ["one", "forced", "round-robin"])
def test_schedules_on_gpus_match_cpu(schedule: str, checkpoint: str, devices: str) -> None:
    if devices == "round-robin" and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    # Two GPUs: round-robin, or a V for the V schedules (stages s and 3 - s on one GPU).
    two = ["cuda:0", "cuda:1", "cuda:1", "cuda:0"] if PLACEMENTS.get(schedule) == "v" else None
    layout = (two or ["cuda:0", "cuda:1"] * 2) if devices == "round-robin" else ["cuda:0"] * 4
    model = mlp([5, 8, 7, 6, 4])
    ref = copy.deepcopy(model)
    pipe = Pipe(
        copy.deepcopy(model),
        split_size=3,
        balance=[2, 2, 2, 2],
        devices=layout,
        schedule=_user_order() if schedule == "custom" else schedule,
        checkpoint=checkpoint,
        force_copies=devices == "forced",
        virtual_stages=2
        if schedule in PLACEMENTS and PLACEMENTS[schedule] != "stage" and devices != "round-robin"
        else None,
    )
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 4, dtype=torch.float64)
    loss = pipe.train_step(x.pin_memory(), y, nn.MSELoss())
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach())
    for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, msg=name)

"""What each process of tests/test_distributed.py runs for BatchNorm
buffers under DDP: two steps (or four, every other one inside ``no_sync()``)
through the DDP forward or ``mpstream.distributed.train_step``, the
statistics after each synchronised step, and after ``sync_buffers``.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream import distributed as mpdist
from tests.ddp_group import LR, SPLIT, WORLD, batches

__all__ = ["norm_model", "run_buffers"]


def norm_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 6), nn.BatchNorm1d(6)
    ).double()


def run_buffers(rank: int, path: str, accumulate: bool = False) -> dict[str, Tensor]:
    """Two steps with BatchNorm; the second must start from rank 0's statistics.
    ``accumulate``: four calls, the even ones inside ``no_sync()`` (DDP then
    broadcasts the buffers only after a call that synchronised)."""
    pipe = Pipe(
        norm_model(),
        split_size=SPLIT,
        balance=[3, 2],
        devices=["cpu", "cpu"],
        schedule="1f1b",
        checkpoint="always",
        deferred_batch_norm=True,
    )
    ddp = mpdist.wrap(pipe)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    out: dict[str, Tensor] = {}
    for step, (x, _) in enumerate(batches(4 if accumulate else 2)):
        xs = x.chunk(WORLD)[rank]
        ys = torch.ones(xs.size(0), 6, dtype=torch.float64)
        local = accumulate and step % 2 == 0
        with ddp.no_sync() if local else contextlib.nullcontext():
            if path == "forward":
                nn.MSELoss()(ddp(xs), ys).backward()
            else:
                mpdist.train_step(ddp, xs, ys, nn.MSELoss())
        if local:
            continue
        opt.step()
        opt.zero_grad()
        out.update({f"{k}@{step}": v.clone() for k, v in pipe.state_dict().items()})
    mpdist.sync_buffers(ddp)
    out.update({f"{k}@synced": v.clone() for k, v in pipe.state_dict().items()})
    return out

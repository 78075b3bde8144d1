"""Two gloo processes on the CPU for the DDP tests: the group, the launch, the data.

:func:`launch` runs a worker in :data:`WORLD` spawned processes that join one
gloo group (:func:`join_group`, loopback only, a FileStore for the
rendezvous) and returns what each saved; :func:`batches` and
:func:`initial_model` are the global batches and the model every process
(and the single-process reference) starts from;
:func:`one_process_group` is a group of this process alone. Used by
tests/test_distributed*.py.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from tests.helpers import mlp

__all__ = [
    "BALANCE",
    "BATCH",
    "LR",
    "SPLIT",
    "WIDTHS",
    "WORLD",
    "batches",
    "initial_model",
    "join_group",
    "launch",
    "one_process_group",
]

WORLD = 2
BATCH = 8  # global batch: 4 per process, 2 micro-batches of 2
SPLIT = 2
LR = 0.1
WIDTHS = [5, 8, 6, 3]  # three Linear+Tanh layers: balance [2, 4]
BALANCE = [2, 4]
# Bounds so a broken collective fails the test instead of hanging it.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
LAUNCH_TIMEOUT = 240.0


def batches(steps: int) -> list[tuple[Tensor, Tensor]]:
    """The global batch of each step, the same in every process."""
    g = torch.Generator().manual_seed(1234)
    return [
        (
            torch.randn(BATCH, WIDTHS[0], generator=g, dtype=torch.float64),
            torch.randn(BATCH, WIDTHS[-1], generator=g, dtype=torch.float64),
        )
        for _ in range(steps)
    ]


def initial_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return mlp(WIDTHS)


def join_group(rank: int, store_path: str) -> None:
    """Joins this test's gloo group of :data:`WORLD` CPU processes."""
    if sys.platform.startswith("linux"):
        # gloo's data connections over loopback only.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT
    )


@contextlib.contextmanager
def one_process_group() -> Iterator[None]:
    """A one-process gloo group on an in-memory store, loopback only, for
    the tests that need a group but no second process."""
    with contextlib.ExitStack() as undo:
        if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
            undo.callback(os.environ.pop, "GLOO_SOCKET_IFNAME", None)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        undo.callback(dist.destroy_process_group)
        yield


def launch(worker: Callable[[int, str, str], None], out_dir: Path) -> list[dict[str, Any]]:
    """Runs ``worker`` in WORLD spawned processes; returns what each saved."""
    ctx = mp.get_context("spawn")
    store = str(out_dir / "store")
    procs = [ctx.Process(target=worker, args=(r, store, str(out_dir))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(LAUNCH_TIMEOUT)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    errors = "\n".join(f.read_text() for f in sorted(out_dir.glob("rank*.err")))
    assert not hung, f"ranks {hung} still running after {LAUNCH_TIMEOUT} s\n{errors}"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * WORLD, f"exit codes {codes}\n{errors}"
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]

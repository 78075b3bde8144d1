"""Group ``graphed``: the host's own work around graphed stages' replays.

Two stages of 80 or 320 parameters (Conv2d + BatchNorm2d blocks, about a
ResNet-101 half at 320), 8 micro-batches, replays that do nothing
(:class:`NoReplay`): what is left is what graphs cannot remove, mpstream's
and autograd's host work per replayed task. Per schedule, in the user's own
loop (``loss.backward()``, what the tutorial's ``train()`` runs) and in
``train_step``: eager aten operators per step and per replayed task
(counted, so checked even untimed: at most 4 per task, the loss's own
included, and no more at 320 parameters per stage than at 80), and host
time per step and per task (timed: ``extra_info``). On a GPU the same
counts hold; what a launch costs there is the GPU run's to measure.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated

MICROS = 8
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"]
#: What the counts must not exceed (issue 41's CPU targets).
MAX_OPS_PER_TASK = 4.0
MAX_GROWTH = 1.1


class NoReplay(Emulated):
    """Graphed stages whose replays do nothing."""

    def replay(self, call: Any, name: str) -> None:
        pass


class Ops(TorchDispatchMode):
    """Counts the aten operators dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def pipe_of(params: int, schedule: str) -> Pipe:
    """Two stages of ``params`` parameters each (4 per block); interleaved:
    four virtual stages of half as many, two per device label."""
    torch.manual_seed(0)
    blocks = params // 4
    layers = [
        nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ReLU()) for _ in range(2 * blocks)
    ]
    if schedule == "interleaved_1f1b":
        half = blocks // 2
        extra: dict[str, Any] = {"balance": [half] * 4, "devices": ["cpu"] * 4, "virtual_stages": 2}
    else:
        extra = {"balance": [blocks, blocks], "devices": ["cpu", "cpu"]}
    return Pipe(
        nn.Sequential(*layers), chunks=MICROS, graphs=NoReplay(), checkpoint="never",
        schedule=schedule, **extra,
    )  # fmt: skip


def runner(pipe: Pipe, run: str) -> Callable[[], None]:
    """One step: the user's own loop, or ``train_step``."""
    x, y = torch.randn(16, 4, 2, 2), torch.randn(16, 4, 2, 2)
    loss = nn.MSELoss()

    def step() -> None:
        if run == "loop":
            loss(pipe(x), y).backward()
        else:
            pipe.train_step(x, y, loss)

    return step


def tasks(pipe: Pipe) -> int:
    """Replayed tasks per step: a forward and a backward per stage and micro-batch."""
    return 2 * len(pipe.partitions) * MICROS


#: Operators per step, by (parameters per stage, schedule, run), as counted.
_COUNTED: dict[tuple[int, str, str], int] = {}


def counted(pipe: Pipe, step: Callable[[], None], key: tuple[int, str, str]) -> Counter[str]:
    """The operators one step dispatches, after capture and a replay."""
    for _ in range(3):
        step()
    with Ops() as seen:
        step()
    assert all(s.graphed for s in pipe.graph_report().stages)
    _COUNTED[key] = sum(seen.ops.values())
    return seen.ops


@pytest.mark.benchmark(group="graphed")
@pytest.mark.parametrize("params", [80, 320])
@pytest.mark.parametrize("run", ["loop", "step"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_graphed_host_work_per_task(benchmark: Any, schedule: str, run: str, params: int) -> None:
    pipe = pipe_of(params, schedule)
    step = runner(pipe, run)
    ops = counted(pipe, step, (params, schedule, run))
    n, total = tasks(pipe), sum(ops.values())
    info = {"tasks": n, "ops_per_step": total, "ops_per_task": round(total / n, 2)}
    benchmark.extra_info.update(info, top_ops=dict(ops.most_common(8)))
    assert total / n <= MAX_OPS_PER_TASK, (info, ops)
    benchmark.pedantic(step, rounds=20, warmup_rounds=0)
    if not benchmark.disabled:
        median = benchmark.stats.stats.median
        benchmark.extra_info.update(
            host_us_per_step=round(median * 1e6, 1), host_us_per_task=round(median * 1e6 / n, 1)
        )


@pytest.mark.parametrize("run", ["loop", "step"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_graphed_host_work_does_not_grow_with_the_parameters(schedule: str, run: str) -> None:
    totals = []
    for params in (80, 320):
        key = (params, schedule, run)
        if key not in _COUNTED:  # run alone, without the test above
            pipe = pipe_of(params, schedule)
            counted(pipe, runner(pipe, run), key)
        totals.append(_COUNTED[key])
    assert totals[1] <= MAX_GROWTH * totals[0], totals


def median_host_us_per_task(params: int, schedule: str, run: str, rounds: int = 30) -> float:
    """Host time per replayed task (median over ``rounds`` steps, after warm-up)."""
    pipe = pipe_of(params, schedule)
    step = runner(pipe, run)
    for _ in range(3):
        step()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e6 / tasks(pipe)

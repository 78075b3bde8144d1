"""Host work around graphed stages' replays, as a script (any commit).

``python benchmarks/graphed_host.py gpipe,1f1b 30`` prints, as JSON, per
schedule, parameters per stage (80, 320) and loop (the user's own,
``train_step``): aten operators per step and per replayed task, Python
function calls per replayed task (mpstream's own, whatever the torch
version, and all of them), and the median host time per step and per task
over interleaved rounds. Two stages of Conv2d + BatchNorm2d blocks, 8
micro-batches, replays that do nothing (:class:`NoReplay`, written for the
replay API before and after commit 56df8da, so the same script measures
both). ``test_graphed.py`` checks the counts in the benchmark suite.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mpstream
from mpstream import Pipe
from mpstream.runtime.graphed import Emulated

MICROS = 8
#: The schedules that run two stages per rank.
RANKED = ("interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")


class NoReplay(Emulated):
    """Graphed stages whose replays do nothing: what is left is the host's
    own work per replayed task, which graphs cannot remove."""

    def replay(self, call: Any, name: str) -> None:
        pass

    # The replay API before 56df8da: one method per pass.
    def forward(self, call: Any) -> None:
        pass

    def backward(self, call: Any) -> None:
        pass

    def weight(self, call: Any) -> None:
        pass


class Ops(TorchDispatchMode):
    """Counts the aten operators dispatched, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def pipe_of(params: int, schedule: str) -> Pipe:
    """Two stages of ``params`` parameters each (4 per block); the schedules
    of several stages per rank: four stages of half as many, two per rank."""
    torch.manual_seed(0)
    blocks = params // 4
    layers = [
        nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ReLU()) for _ in range(2 * blocks)
    ]
    if schedule in RANKED:
        extra: dict[str, Any] = {
            "balance": [blocks // 2] * 4, "devices": ["cpu"] * 4, "virtual_stages": 2,
        }  # fmt: skip
    else:
        extra = {"balance": [blocks, blocks], "devices": ["cpu", "cpu"]}
    return Pipe(
        nn.Sequential(*layers), chunks=MICROS, graphs=NoReplay(), checkpoint="never",
        schedule=schedule, **extra,
    )  # fmt: skip


def runner(pipe: Pipe, run: str) -> Callable[[], None]:
    """One step: the user's own loop (``loop``), or ``train_step`` (``step``)."""
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


def count(pipe: Pipe, step: Callable[[], None]) -> Counter[str]:
    """The operators one step dispatches, after capture and a replay."""
    for _ in range(3):
        step()
    with Ops() as seen:
        step()
    return seen.ops


#: Where mpstream's own code lives: its frames are the counts that do not
#: depend on the torch version.
OWN = os.path.dirname(os.path.abspath(mpstream.__file__)) + os.sep


def python_calls(step: Callable[[], None]) -> tuple[int, int]:
    """The Python function calls one step makes (after capture and a
    replay): mpstream's own, and all (a generator's resumption counts as one)."""
    for _ in range(3):
        step()
    own: dict[Any, bool] = {}
    counts = [0, 0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            mine = own.get(code)
            if mine is None:
                mine = own[code] = os.path.abspath(code.co_filename).startswith(OWN)
            counts[0] += mine
            counts[1] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return counts[0], counts[1]


def main(schedules: list[str], rounds: int) -> list[dict[str, Any]]:
    steps, results = {}, {}
    for schedule in schedules:
        for params in (80, 320):
            for run in ("loop", "step"):
                pipe = pipe_of(params, schedule)
                step = runner(pipe, run)
                ops = sum(count(pipe, step).values())
                own, every = python_calls(step)
                steps[(schedule, params, run)] = step
                results[(schedule, params, run)] = (ops, own, every, tasks(pipe), [])
    for _ in range(rounds):  # interleaved: drift on a shared machine hits all alike
        for key, step in steps.items():
            start = time.perf_counter()
            step()
            results[key][4].append(time.perf_counter() - start)
    out = []
    for (schedule, params, run), (ops, own, every, n, times) in results.items():
        median = statistics.median(times) * 1e6
        out.append(
            {
                "schedule": schedule, "params_per_stage": params, "loop": run,
                "ops_per_step": ops, "ops_per_task": round(ops / n, 2),
                "mpstream_calls_per_task": round(own / n, 2),
                "python_calls_per_task": round(every / n, 2),
                "host_us_per_step": round(median, 1), "host_us_per_task": round(median / n, 1),
            }
        )  # fmt: skip
    return out


if __name__ == "__main__":
    chosen = sys.argv[1].split(",") if len(sys.argv) > 1 else ["gpipe", "1f1b"]
    print(json.dumps(main(chosen, int(sys.argv[2]) if len(sys.argv) > 2 else 30), indent=1))

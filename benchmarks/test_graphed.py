"""Group ``graphed``: the host's own work around graphed stages' replays.

Two stages of 80 or 320 parameters (Conv2d + BatchNorm2d blocks, about a
ResNet-101 half at 320), 8 micro-batches, replays that do nothing
(``graphed_host.NoReplay``): what is left is what graphs cannot remove, mpstream's
and autograd's host work per replayed task. Per schedule, in the user's own
loop (``loss.backward()``, what the tutorial's ``train()`` runs) and in
``train_step``: eager aten operators per step and per replayed task
(counted, so checked even untimed: at most 3 per task, the loss's own
included, and no more at 320 parameters per stage than at 80), mpstream's
own Python calls per replayed task (counted: bounded for one schedule per
loop), and host time per step and per task (timed: ``extra_info``). On a
GPU the same counts hold; what a launch costs there is the GPU run's to
measure.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from mpstream import Pipe

from .graphed_host import RANKED, count, pipe_of, python_calls, runner, tasks

SCHEDULES = ["gpipe", "1f1b", "zb_h1", *RANKED]
#: What the counts must not exceed (issue 41's CPU target was 4 per task;
#: 1.1-2.8 since the loss's weight seeds its backward and the anchor's
#: gradient accumulator is held).
MAX_OPS_PER_TASK = 3.0
MAX_GROWTH = 1.1
#: mpstream's own Python calls per replayed task (only frames of mpstream's
#: files: whatever the torch version), by loop: what was counted on Python
#: 3.11 (12.03 in the user's loop, 16.19 in ``train_step``; 26.69 and 35.38
#: before the replays were thinned) plus a small margin (under a call per
#: task), so that a call added per task shows. From Python 3.12 list, dict
#: and set comprehensions are no frames of their own: fewer are counted.
MAX_OWN_CALLS_PER_TASK = {"loop": 13.0, "step": 17.0}


#: Operators per step, by (parameters per stage, schedule, run), as counted.
_COUNTED: dict[tuple[int, str, str], int] = {}


def counted(pipe: Pipe, step: Callable[[], None], key: tuple[int, str, str]) -> Counter[str]:
    """The operators one step dispatches, after capture and a replay."""
    ops = count(pipe, step)
    assert all(s.graphed for s in pipe.graph_report().stages)
    _COUNTED[key] = sum(ops.values())
    return ops


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


@pytest.mark.parametrize("run", ["loop", "step"])
def test_graphed_host_python_calls_per_task(run: str) -> None:
    pipe = pipe_of(80, "1f1b")
    own, every = python_calls(runner(pipe, run))
    n = tasks(pipe)
    assert all(s.graphed for s in pipe.graph_report().stages)
    info = {"own_per_task": round(own / n, 2), "all_per_task": round(every / n, 2)}
    assert own / n <= MAX_OWN_CALLS_PER_TASK[run], info

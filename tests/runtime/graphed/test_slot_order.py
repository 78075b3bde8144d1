"""A graphed stage's slot is written again only after the device is done
reading it: stream order, not host order.

A replayed stage hands its static outputs on uncopied (runtime/replayed.py),
and its next forward into the same slot rewrites them. Host order is
:func:`~mpstream.schedules.slots.check_slots`'s; on a GPU what counts is
stream order: every task that reads a micro-batch's outputs in place (a
reader's forward, a copy, a reader's backward through what it saved) must
be ordered, through its stream and the events of the recorded plan, before
the producer's forward of the next micro-batch in that slot, and every
reader's backward of that next micro-batch (which may write its output
gradient into the slot's buffer) after the producer's last pass of the
previous one. :func:`~mpstream.runtime.plan.verify_plan` checks read-after-write order
only; this checks the write-after-read order slots rely on, on the CPU (the
plan a real scheduler records; graphs emulated). A reader's weight pass is
not so ordered (it may run after the producer's next forward), which is why
a split reader never reads the buffers in place: an eager one reads a copy
(``Replayed.unalias``), a graphed one its graph's own copy.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated
from mpstream.runtime.scheduler import PlanOp
from tests.runtime.test_uses import Skip, chain

# A task as the plan names it: (kind, stage, peer, micro).
Key = tuple[str, int, int, int]


def _unordered(
    pipe: Pipe, ops: list[PlanOp], kinds: tuple[str, ...] = ("forward", "backward")
) -> tuple[list[str], int]:
    """The in-place reads of a graphed stage's outputs not ordered before its
    next forward into the same slot, and how many reads were checked: its
    copies, and its readers' tasks of ``kinds``."""
    graph = pipe.__dict__["_graph"]
    readers: dict[int, set[int]] = defaultdict(set)
    for q, refs in enumerate(graph.args):
        for r in refs:
            if r.stage >= 0:
                readers[r.stage].add(q)
    for r in graph.result_refs():  # read by the loss, in the last stage's tasks
        readers[r.stage].add(len(graph.args) - 1)
    edges: dict[int, list[int]] = defaultdict(list)
    last: dict[int, int] = {}
    recorded: dict[int, int] = {}
    runs: dict[Key, int] = {}
    for i, op in enumerate(ops):
        if op.slot in last:
            edges[last[op.slot]].append(i)
        last[op.slot] = i
        if op.op == "record":
            recorded[op.event] = i
        elif op.op in ("wait", "sync", "autograd"):
            edges[recorded[op.event]].append(i)
        elif op.op == "run" and op.task >= 0:
            runs[(op.kind, op.stage, op.peer, op.micro)] = i

    def reach(start: int) -> set[int]:
        seen, stack = {start}, [start]
        while stack:
            for b in edges[stack.pop()]:
                if b not in seen:
                    seen.add(b)
                    stack.append(b)
        return seen

    slots = pipe._rt().worker.graphs.slots.slot
    forwards = sorted((i, key) for key, i in runs.items() if key[0] == "forward")
    problems: list[str] = []
    checked = 0
    for p in range(len(graph.args)):
        order = [key[3] for _, key in forwards if key[1] == p]
        for n, m in enumerate(order):
            later = [k for k in order[n + 1 :] if slots[(p, k)] == slots[(p, m)]]
            if not later:
                continue
            rewrite = runs[("forward", p, p, later[0])]
            for (kind, stage, peer, micro), i in runs.items():
                reads = (kind in kinds and stage in readers[p]) or (kind == "copy" and stage == p)
                if micro != m or not reads:
                    continue
                checked += 1
                if rewrite not in reach(i):
                    problems.append(
                        f"{kind}(stage={stage}, peer={peer}, micro={m}) is not ordered before "
                        f"stage {p}'s forward of micro-batch {later[0]} into the same slot"
                    )
            # A reader's backward writes the next micro-batch's output
            # gradient into the slot's buffer (Replayed._push), which the
            # producer's last pass of this one (W, or B) reads.
            done = max(i for key, i in runs.items() if key[1:] == (p, p, m) and key[0] != "forward")
            for (kind, stage, _, micro), i in runs.items():
                if kind == "backward" and micro == later[0] and stage in readers[p]:
                    checked += 1
                    if i not in reach(done):
                        problems.append(
                            f"backward(stage={stage}, micro={micro}) is not ordered after stage "
                            f"{p}'s last pass of micro-batch {m} from the same slot"
                        )
    return problems, checked


def _pipe(schedule: str, force: bool) -> Pipe:
    torch.manual_seed(0)
    if schedule in ("interleaved_1f1b", "interleaved_zb", "zbv"):
        layers = list(chain())
        model = nn.Sequential(*layers[:4], nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
        return Pipe(
            model.double(), balance=[2, 2, 2, 1], virtual_stages=2, chunks=8,
            force_copies=force, schedule=schedule, graphs=Emulated(),
        )  # fmt: skip
    return Pipe(
        Skip().double(), split_points=["b", "c", "d"], chunks=8, force_copies=force,
        sample=torch.randn(2, 6, dtype=torch.float64), schedule=schedule, graphs=Emulated(),
    )  # fmt: skip


def _recorded(pipe: Pipe) -> list[PlanOp]:
    """The plan of a training step, once the pipe's graphs are captured."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 6, generator=g, dtype=torch.float64)
    y = torch.randn(16, 2, generator=g, dtype=torch.float64)
    pipe.train_step(x, y, nn.MSELoss())  # captured
    pipe.scheduler.recording = True
    try:
        pipe.train_step(x, y, nn.MSELoss())
        return pipe.scheduler.plan()
    finally:
        pipe.scheduler.recording = False
        pipe.scheduler.clear_plan()


@pytest.mark.parametrize("force", [True, False], ids=["copies", "shared"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "interleaved_1f1b", "interleaved_zb", "zbv"])
def test_a_slot_is_rewritten_after_every_in_place_read_of_it(schedule: str, force: bool) -> None:
    pipe = _pipe(schedule, force)
    ops = _recorded(pipe)
    assert all(s.graphed for s in pipe.graph_report().stages)
    assert max(pipe._rt().worker.graphs.slots.counts) < 8  # slots are reused
    problems, checked = _unordered(pipe, ops)
    assert problems == []
    assert checked > 0


def test_a_readers_weight_pass_is_not_ordered_before_the_slot_s_next_forward() -> None:
    """Why a split reader reads a copy: the check finds its weight passes
    unordered (and so has teeth)."""
    pipe = _pipe("zb_h1", force=False)
    problems, _ = _unordered(pipe, _recorded(pipe), kinds=("weight",))
    assert problems and all(p.startswith("weight(") for p in problems)

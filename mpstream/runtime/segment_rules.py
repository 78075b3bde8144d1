"""The rules only a segmented plan must follow, for :func:`~.plan.verify_plan`.

In a segmented run each segment is captured as a CUDA graph of its own, and a
capture has rules of its own beyond data order: a stream takes part only
once it has joined (waited on an event recorded in the segment), every stream
it forked must rejoin the capturing stream before it ends, and a segment
holds one device's work. Each rule returns its violations as messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from .scheduler import PlanOp

__all__ = ["Ops", "unforked", "foreign", "unjoined"]


class Ops(Protocol):
    """What the rules read of a recorded plan (:class:`~.plan.Plan` has it;
    a protocol, so that this module does not import the one that imports it)."""

    @property
    def ops(self) -> list[PlanOp]: ...

    @property
    def slot_names(self) -> list[str]: ...

    @property
    def slot_devices(self) -> list[torch.device]: ...


def unforked(plan: Ops, segment_of: Sequence[int]) -> list[str]:
    """Streams a segment used before they joined it: a stream takes part in a
    capture only once it waits on an event recorded inside it, so its first
    op in a segment must be such a wait (the caller slot captures from the
    start)."""
    problems = []
    recorded_in: dict[int, int] = {}  # event -> segment of its last record
    joined: set[tuple[int, int]] = set()  # (segment, slot)
    callers: dict[int, int] = {}  # segment -> its caller slot
    for i, op in enumerate(plan.ops):
        k = segment_of[i]
        if op.op == "begin_segment":
            callers[k] = op.slot
        if k < 0 or op.op in ("begin_segment", "end_segment") or op.slot == callers[k]:
            pass
        elif (k, op.slot) not in joined:
            if op.op in ("wait", "sync", "autograd") and recorded_in.get(op.event) == k:
                joined.add((k, op.slot))
            else:
                problems.append(
                    f"segment {k}: {plan.slot_names[op.slot]} is used (op {i}, {op.op}) "
                    f"before it joined the segment"
                )
                joined.add((k, op.slot))  # one report per stream and segment
        if op.op == "record":
            recorded_in[op.event] = k
    return problems


def foreign(plan: Ops, segment_of: Sequence[int]) -> list[str]:
    """Streams of another device in a segment: each device's segments are
    captured there, so a copy between devices must run wholly on one side
    (the receiver pulls)."""
    problems = []
    device: dict[int, torch.device] = {}  # segment -> its caller slot's device
    reported: set[tuple[int, int]] = set()
    for i, op in enumerate(plan.ops):
        k = segment_of[i]
        if op.op == "begin_segment":
            device[k] = plan.slot_devices[op.slot]
        if k < 0 or plan.slot_devices[op.slot] == device[k] or (k, op.slot) in reported:
            continue
        reported.add((k, op.slot))
        problems.append(
            f"segment {k} (captured on {device[k]}) uses {plan.slot_names[op.slot]} "
            f"(op {i}, {op.op}): a segment holds one device's work"
        )
    return problems


def unjoined(plan: Ops, segment_of: Sequence[int], reach: Callable[[int], set[int]]) -> list[str]:
    """Streams a segment used but did not join into its caller slot before it
    ended: a capture ends only once every stream it forked has rejoined."""
    problems = []
    ops = plan.ops
    for e, op in enumerate(ops):
        if op.op != "end_segment":
            continue
        k, caller = op.event, op.slot
        inside = [j for j in range(e + 1) if segment_of[j] == k]
        joins = {j for j in inside if ops[j].slot == caller}
        last: dict[int, int] = {}
        for j in inside:
            if ops[j].slot != caller:
                last[ops[j].slot] = j
        for slot, j in sorted(last.items()):
            if not reach(j) & joins:
                problems.append(
                    f"segment {k}: {plan.slot_names[slot]} is not joined into "
                    f"{plan.slot_names[caller]} before the segment ends"
                )
    return problems

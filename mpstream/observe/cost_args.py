"""How the cost model reads the costs it is given.

A cost is one number (a forward alone, or both directions for a copy), a
(forward, backward) pair, a (forward, input pass, weight pass) triple, or a
(forward, input pass, weight pass, backward) quadruple: a stage whose
backward the schedule splits for some micro-batches and runs whole for
others (``'dualpipev'``) was timed both ways, and a whole backward (one
autograd pass) costs less than its two split passes, most for small tasks;
:func:`cost_pair` and :func:`backward_passes` read one, :func:`issue_costs`
and :func:`copy_costs` turn :func:`~mpstream.observe.cost_model.simulate`'s
``issue_times`` and ``copy_times`` into functions of a task or a hop, and
refuse what cannot be a time, naming the argument; :func:`device_label`
reads its ``input_device``; :func:`check_hops` and :func:`check_sizes` refuse
a ``copy_times`` mapping of hops the stage graph lacks, and ``chunks`` and
``last_size`` that are no micro-batch count and size.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping, Sequence
from typing import Any, cast

from .._words import count_of
from ..schedules import Kind, Task

__all__ = [
    "Cost",
    "IssueTimes",
    "backward_passes",
    "check_hops",
    "check_listed",
    "check_sizes",
    "copy_costs",
    "cost_pair",
    "cost_size",
    "device_label",
    "issue_costs",
]

Cost = float | tuple[float, float] | tuple[float, float, float] | tuple[float, float, float, float]
# Host issue time per task: one for every task, or per (kind, stage), the
# kind as a timeline span names it ("forward", "backward", "copy", ...), or
# "whole_backward" for a backward the schedule does not split where it
# splits others (as fit measures it; default: "backward" + "weight").
IssueTimes = float | Mapping[tuple[str, int], float]


def cost_pair(cost: Cost, what: str, *, both: bool = False) -> tuple[float, float]:
    """A (forward, backward) pair, the backward a whole one. A single number
    is the forward alone, or both directions with ``both`` (a gradient is as
    large as its activation); a triple's backward is its input and weight
    passes together, a quadruple's its last entry."""
    if isinstance(cost, (int, float, numbers.Real)):
        pair = (float(cost), float(cost) if both else 0.0)
    elif cost_size(cost) not in (2, 3, 4):
        raise ValueError(
            f"{what} must be a number, a (forward, backward) pair, a (forward, input_grad, "
            f"weight_grad) triple or a (forward, input_grad, weight_grad, backward) "
            f"quadruple, got {cost!r}"
        )
    elif len(cost) == 3:
        pair = (float(cost[0]), float(cost[1]) + float(cost[2]))
    else:
        pair = (float(cost[0]), float(cost[-1]))
    parts = [cost] if isinstance(cost, (int, float, numbers.Real)) else list(cost)
    if not all(math.isfinite(float(c)) and float(c) >= 0 for c in parts):
        raise ValueError(f"{what} must be finite and not negative, got {cost}")
    return pair


def check_listed(times: object, what: str) -> None:
    """Refuses a mapping of times: iterating it would read its keys (the
    stage or layer numbers) as the times, a wrong result without an error."""
    if isinstance(times, Mapping):
        raise ValueError(
            f"{what} must be a sequence with one entry per {what.split('_')[0]}, in order, "
            f"not a {type(times).__name__}; give list({what}.values()) if its keys are 0, 1, ..."
        )


def cost_size(cost: object) -> int:
    """How many numbers a cost holds (a tuple, a list, an array's row); -1
    for something without a length."""
    try:
        return len(cost)  # type: ignore[arg-type]
    except TypeError:
        return -1


def backward_passes(cost: Cost) -> tuple[float, float]:
    """(input pass, weight pass) of a stage's split backward."""
    # Any triple or quadruple (a list, an array's row), as cost_pair reads one.
    if cost_size(cost) in (3, 4):
        inputs, weights = cast(Sequence[float], cost)[1:3]
        return float(inputs), float(weights)
    backward = cost_pair(cost, "stage time")[1]
    return backward / 2, backward / 2


def issue_costs(issue_times: IssueTimes | None, split: frozenset[tuple[int, int]]) -> Any:
    """A function task -> host issue time; ``split``: the (stage, micro-batch)
    pairs whose backward the schedule splits."""
    if issue_times is None:
        return lambda t: 0.0
    if isinstance(issue_times, (int, float, numbers.Real)):
        if not math.isfinite(issue_times) or issue_times < 0:
            raise ValueError(f"issue_times must be finite and not negative, got {issue_times}")
        each = float(issue_times)
        return lambda t: each
    table = {key: float(v) for key, v in issue_times.items()}
    if not all(math.isfinite(v) and v >= 0 for v in table.values()):
        raise ValueError(f"issue_times must be finite and not negative, got {issue_times}")
    kinds = {k.label for k in Kind} | {"whole_backward"}
    for key in table:
        if not (isinstance(key, tuple) and len(key) == 2 and key[0] in kinds):
            raise ValueError(
                f"issue_times key {key!r}: expected (kind, stage) with kind one of "
                f"{', '.join(sorted(kinds))}, as Costs.issue_times holds them"
            )

    def passes(stage: int) -> tuple[float, float]:
        """(input pass, weight pass) issue times of a stage's backward."""
        backward = table.get(("backward", stage), 0.0)
        if ("weight", stage) in table:
            return backward, table[("weight", stage)]
        return backward / 2, backward / 2

    def of(t: Task) -> float:
        if t.kind is Kind.WEIGHT:
            return passes(t.stage)[1]
        if t.kind is Kind.BACKWARD:
            b, w = passes(t.stage)
            if (t.stage, t.micro) in split:
                return b
            return table.get(("whole_backward", t.stage), b + w)
        return table.get((t.kind.label, t.stage), 0.0)

    return of


def copy_costs(
    copy_times: Cost | Sequence[Cost] | Mapping[tuple[int, int], Cost], n: int, chain: bool
) -> Any:
    """A function (producer, receiving stage) -> (forward, gradient) copy time."""
    if isinstance(copy_times, (int, float, numbers.Real, tuple)):
        both = cost_pair(copy_times, "copy time", both=True)
        return lambda p, q: both
    if isinstance(copy_times, Mapping):
        hops = {k: cost_pair(c, f"copy time {k}", both=True) for k, c in copy_times.items()}
        return lambda p, q: hops.get((p, q), (0.0, 0.0))
    per = [cost_pair(c, f"copy time {i}", both=True) for i, c in enumerate(copy_times)]
    if len(per) != n - 1:
        what = "one per boundary" if chain else "one per producing stage but the last"
        raise ValueError(
            f"copy_times needs {count_of(n - 1, 'entry', 'entries')} ({what}), got {len(per)}"
        )
    return lambda p, q: per[p] if 0 <= p < len(per) else (0.0, 0.0)


def device_label(device: object) -> str:
    """``input_device`` as a label of the devices: a string, or a
    ``torch.device``'s name."""
    import torch

    if isinstance(device, torch.device):
        return str(device)
    if not isinstance(device, str):
        raise TypeError(
            f"input_device is where the batch sits, a label as devices= lists them (or a "
            f"torch.device), got {type(device).__name__}"
        )
    if not device.strip():
        raise ValueError("input_device is empty: give a label of devices=, or leave it None")
    return device


def check_hops(
    copy_times: Mapping[tuple[int, int], Any],
    graph: Sequence[Sequence[int]] | None,
    devices: Sequence[str],
    source: str,
    force_copies: bool,
) -> None:
    """Refuses a ``copy_times`` mapping naming a hop that the stage graph
    (``graph``, None: a chain) does not copy: between stages, or into a
    stage off the batch's device ``source`` (into any with ``force_copies``).

    Raises:
        ValueError: naming the unknown hops and the graph's.
    """
    chain = tuple((s - 1,) for s in range(len(devices)))
    hops = {
        (p, q)
        for q, r in enumerate(graph or chain)
        for p in r
        if p >= 0 or (force_copies or devices[q] != source)
    }
    unknown = sorted(set(copy_times) - hops)
    if unknown:
        raise ValueError(
            f"copy_times names hops {unknown} that the stage graph does not have; its "
            f"hops (producer, receiving stage): {sorted(hops)}"
        )


def check_sizes(chunks: int, last_size: float) -> int:
    """``chunks`` as an int, once it and ``last_size`` (the last
    micro-batch's size over a full one's) are checked.

    Raises:
        ValueError: ``chunks`` is not an int, or ``last_size`` is not a
            number in (0, 1].
    """
    try:
        count = operator.index(chunks)
    except TypeError:
        raise ValueError(f"chunks must be an int, got {chunks!r}") from None
    if isinstance(last_size, bool) or not (
        isinstance(last_size, numbers.Real) and 0 < last_size <= 1
    ):
        raise ValueError(
            f"last_size is the last micro-batch's size over a full one's, in (0, 1]; got "
            f"{last_size!r} (micro_batches(batch_size, split_size) gives it)"
        )
    return count

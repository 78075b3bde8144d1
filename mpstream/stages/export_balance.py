"""``balance='time'|'size'`` for a module split by ``torch.export``.

As :func:`~mpstream.stages.balance.split_points_by` does for ``torch.fx``: a
copy of the module, in its mode, is exported on ``sample`` and cut before
every unit it calls (its children and the items of its ``ModuleList`` /
``Sequential`` children: a transformer's blocks), each part is profiled on
what it reads (:func:`~mpstream.stages.balance.profile_call`), and the split points
are those of the contiguous split whose slowest (or largest) stage is
smallest.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from .._words import count_of
from ..runtime.microbatch import NoChunk
from .balance import profile_call
from .export import call_order, export_stages
from .fake_export import exported_graph
from .hf import calls_for
from .module_hooks import entering
from .partition import partition
from .tracers import CallSignature, sample_call

__all__ = ["export_split_points"]


def _on(x: Any, device: torch.device) -> Any:
    if isinstance(x, NoChunk):
        x = x.tensor
    return x.detach().to(device) if isinstance(x, Tensor) else x


def export_split_points(
    how: str, module: nn.Module, sample: Any, stages: int, device: torch.device
) -> list[str]:
    """Split points for ``stages`` stages: the contiguous split of the
    module's units with the smallest slowest stage (``how='time'``) or the
    smallest largest stage in memory (``'size'``), profiled on ``sample``.

    Raises:
        ValueError: ``how`` is neither, or fewer units than stages.
        TypeError: the module could not be exported on ``sample``; a module
            the export enters holds a hook (see
            :func:`~mpstream.stages.module_hooks.entering`).
    """
    if how not in ("time", "size"):
        raise ValueError(f"balance must be 'time' or 'size'; got {how!r}")
    model = copy.deepcopy(module).to(device)  # in its mode, as the pipe first exports it
    calls = calls_for(model)
    args, kwargs = sample_call(sample)
    named = calls.prepare(CallSignature(model)(args, kwargs))
    try:
        # A hook on a module the export enters would run on its stand-ins:
        # refused as the pipe's own export refuses it, before it runs.
        with entering(model, "export"):
            exported = exported_graph(model, named, device)
            points = call_order(exported[0], model)
            split = export_stages(
                model, points, named, device, calls.weighs_loss(named), exported=exported
            )
    except (TypeError, ValueError):
        raise
    except Exception as exc:
        raise TypeError(
            f"torch.export could not export {type(module).__name__} on the sample to balance "
            f"it: {exc}"
        ) from exc
    items = [_on(x, device) for x in pytree.tree_leaves(((), named))]
    if split.loss is not None:
        batch = next(x.size(0) for x in items if isinstance(x, Tensor) and x.dim())
        items.append(split.loss.shares(items, batch))
    outs: list[tuple[Any, ...]] = []
    costs = []
    counted: set[int] = set()
    names = ["(start)", *points]
    for s, (part, refs) in enumerate(zip(split.partitions, split.graph.args)):
        part_args = tuple(
            _on(items[r.index] if r.stage < 0 else outs[r.stage][r.index], device) for r in refs
        )
        profile, y = profile_call(names[s], part, part_args, device, 3 if how == "time" else 1,
                                  counted)  # fmt: skip
        costs.append(profile.time_ms if how == "time" else float(profile.training_bytes()))
        outs.append(y if split.graph.outputs[s] > 1 else (y,))
    if len(costs) < stages:
        raise ValueError(
            f"{type(module).__name__} has {count_of(len(costs), 'unit')} to split "
            f"({', '.join(points)} and what precedes them) but {stages} stages were asked for"
        )
    balance = partition(costs, stages)
    return [points[sum(balance[:k]) - 1] for k in range(1, stages)]

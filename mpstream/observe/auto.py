"""``schedule="auto"``'s chooser: each fitting schedule simulated on measured costs.

A :class:`~mpstream.Pipe` with ``schedule="auto"`` asks, at its first
``train_step``, the chooser :mod:`mpstream.observe` installs
(:func:`mpstream.pipe.install_chooser`) which built-in schedule to run.
:func:`choose_schedule` answers it:

1. Costs per stage, (forward, input_grad, weight_grad) per micro-batch:
   those given (``Auto(costs=...)``); else those kept in the tuning cache
   (``mpstream.tune``'s JSON file) for this model, its settings, devices,
   batch, loss and torch; else a profile of the step under ``'zb_h1'``
   (:func:`~mpstream.observe.measuring.profile_stages`: a warm-up step and
   two timed ones, so the forward and both backward passes are timed
   apart), fitted (:func:`~mpstream.observe.fitting.fit`) with the copies
   and the host's issue times, and kept in the cache.
2. With a memory budget, each stage's activation bytes per micro-batch:
   those given, or one fill-drain step's peak bytes saved for backward per
   stage (:class:`~mpstream.memory.StageSavedBytes`) over its micro-batches.
3. Every fitting schedule simulated on the pipe's own devices and stage
   graph (stages sharing a device compute one at a time, as ``mpstream
   schedules`` compares them), its peak activations per device from its
   issue order; the fastest within the budget wins
   (:func:`~mpstream.schedules.pick`).

The measuring steps leave the pipe's gradients, BatchNorm statistics and
random-number state as they were.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .._warn import warn
from .._words import count_of
from ..memory import StageSavedBytes
from ..pipe import AutoRequest, Pipe
from ..runtime import synchronize
from ..schedules import (
    Candidate,
    Schedule,
    ScheduleReport,
    Topology,
    peak_activations,
    pick,
    placement_of,
)
from .cost_model import simulate
from .measuring import profile_stages, scheduled, untouched
from .tune_cache import batch_shape, default_cache, load, loss_key, model_key, store

__all__ = ["choose_schedule", "simulate_candidates"]

Triple = tuple[float, float, float]


def choose_schedule(pipe: Pipe, request: AutoRequest) -> ScheduleReport:
    """Picks ``pipe``'s schedule for ``request`` (see the module docstring).

    Args:
        pipe: the pipe whose ``schedule`` is ``'auto'``.
        request: what it asks: the options, the first step's batch, its
            micro-batch count and the schedules that fit.

    Returns:
        The report: the choice, and every candidate's simulated step and
        peak activations per device.

    Raises:
        ValueError: the given costs or activation bytes do not have one
            entry per stage, or no schedule fits the memory budget.
    """
    auto = request.auto
    stages = len(pipe.devices)

    def check(what: str, values: Sequence[Any] | None) -> None:
        if values is not None and len(values) != stages:
            raise ValueError(
                f"Auto({what}=...) needs one entry per stage ({stages}), got {len(values)}"
            )

    # What was given is checked before anything is measured for the rest.
    check("costs", auto.costs)
    check("activation_bytes", auto.activation_bytes)
    costs, copies, issue, source = _costs(pipe, request)
    need_bytes = auto.memory_budget is not None and auto.activation_bytes is None
    held = _stage_bytes(pipe, request) if need_bytes else auto.activation_bytes
    check("costs", costs)
    check("activation_bytes", held)
    labels = [str(d) for d in pipe.devices]
    out = simulate_candidates(
        request.candidates,
        costs,
        labels,
        request.micros,
        reads=pipe.graph.reads(),
        copy_times=copies,
        issue_times=issue,
        stage_bytes=held,
        memory_budget=auto.memory_budget,
    )
    chosen = pick(out, pipe.checkpoint)
    return ScheduleReport(
        chosen.schedule,
        chosen.virtual_stages,
        request.micros,
        tuple(out),
        request.excluded,
        tuple(costs),
        source,
        auto.memory_budget,
    )


def simulate_candidates(
    candidates: Sequence[tuple[str, int]],
    costs: Sequence[Triple],
    devices: Sequence[str],
    micros: int,
    *,
    reads: Sequence[Sequence[int]] | None = None,
    copy_times: Any = 0.0,
    issue_times: dict[tuple[str, int], float] | None = None,
    stage_bytes: Sequence[float] | None = None,
    memory_budget: float | None = None,
) -> list[Candidate]:
    """Each candidate schedule simulated on the same costs and devices.

    Stages sharing a device compute one at a time, in issue order, for every
    schedule alike (``share_compute=True``, as ``mpstream schedules``
    compares them).

    Args:
        candidates: (schedule, virtual stages) pairs, e.g. from
            :func:`mpstream.pipe.auto.candidates`.
        costs: per stage, (forward, input_grad, weight_grad) per micro-batch.
        devices: per stage, its device's label.
        micros: micro-batches per step.
        reads: the stage graph (default a chain).
        copy_times: copy costs, as :func:`~mpstream.observe.cost_model.simulate` takes them.
        issue_times: the host's issue time per (kind, stage), if measured.
        stage_bytes: per stage, the activation bytes of one micro-batch
            (None: no peak memory, every candidate within the budget).
        memory_budget: bytes each device may hold.

    Returns:
        A :class:`~mpstream.schedules.Candidate` per schedule, in the given order.
    """
    graph = [list(r) for r in reads] if reads is not None else [[s - 1] for s in range(len(costs))]
    names = list(dict.fromkeys(devices))
    topology = Topology(tuple(tuple(r) for r in graph), tuple(names.index(d) for d in devices))
    out = []
    for name, virtual in candidates:
        several = placement_of(name) != "stage"
        sim = simulate(
            list(costs),
            copy_times,
            micros,
            name,
            devices=list(devices),
            reads=graph,
            virtual_stages=virtual if several else None,
            share_compute=True,
            issue_times=issue_times,
        )
        peak: dict[str, float] = {}
        if stage_bytes is not None:
            sched = Schedule(
                name,
                len(costs),
                micros,
                topology,
                True,
                virtual_stages=virtual if several else None,
            )
            peak = peak_activations(sched, stage_bytes, devices)
        within = memory_budget is None or all(v <= memory_budget for v in peak.values())
        out.append(Candidate(name, virtual, sim.step_ms, peak, within))
    return out


def _costs(
    pipe: Pipe, request: AutoRequest
) -> tuple[Sequence[Triple], Any, dict[tuple[str, int], float] | None, str]:
    """(stage costs, copy costs, issue times, where they came from)."""
    auto = request.auto
    if auto.costs is not None:
        return auto.costs, 0.0, None, "given (Auto(costs=...))"
    path = (
        None
        if auto.cache is None
        else (default_cache() if auto.cache == "default" else Path(auto.cache))
    )
    key = json.dumps(_key(pipe, request), sort_keys=True)
    stages = len(pipe.devices)
    if path is not None:
        entry = load(path).get(key)
        if entry is not None:
            try:
                return _cached(entry, stages) + (f"the tuning cache {path}",)
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                # As tune's: measured again, and replaced (an error would
                # blame Auto(costs=...), which was not given).
                warn(
                    f"ignoring a malformed entry of the tuning cache {path}: {exc!r}; "
                    f"measuring the stage costs again"
                )
    fitted = profile_stages(pipe, request.inputs, request.target, request.loss_fn)
    triples = [_triple(c) for c in fitted.per_stage()]
    hops = {f"{p},{q}": list(c) for (p, q), c in fitted.hops.items()}
    issue = {f"{k},{s}": v for (k, s), v in fitted.issue_times.items()}
    entry = {"stage_costs": triples, "hops": hops, "issue_times": issue}
    if path is not None:
        store(path, key, entry)
    return _decoded(entry) + ("profiled: two zb_h1 steps, forward, B and W timed apart",)


def _triple(cost: Any) -> Triple:
    f, *rest = cost
    if len(rest) == 2:
        return (float(f), float(rest[0]), float(rest[1]))
    return (float(f), float(rest[0]) / 2, float(rest[0]) / 2)


def _cached(
    entry: Any, stages: int
) -> tuple[list[Triple], Any, dict[tuple[str, int], float] | None]:
    """A cache entry's costs, decoded and checked.

    Raises:
        ValueError: not one triple of finite costs >= 0 per stage (and
            KeyError, TypeError or AttributeError: not an entry's shape).
    """
    decoded = _decoded(entry)
    triples = decoded[0]
    if len(triples) != stages:
        raise ValueError(
            f"{count_of(len(triples), 'stage cost')} for a pipe of {count_of(stages, 'stage')}"
        )
    if not all(math.isfinite(c) and c >= 0 for t in triples for c in t):
        raise ValueError("a stage cost that is negative or not finite")
    return decoded


def _decoded(
    entry: dict[str, Any],
) -> tuple[list[Triple], Any, dict[tuple[str, int], float] | None]:
    """A cache entry's costs, as :func:`simulate` takes them."""
    triples = [(float(f), float(b), float(w)) for f, b, w in entry["stage_costs"]]
    hops = {
        (int(k.split(",")[0]), int(k.split(",")[1])): (float(a), float(b))
        for k, (a, b) in entry["hops"].items()
    }
    issue = {
        (k.rsplit(",", 1)[0], int(k.rsplit(",", 1)[1])): float(v)
        for k, v in entry["issue_times"].items()
    }
    return triples, hops or 0.0, issue or None


def _key(pipe: Pipe, request: AutoRequest) -> dict[str, Any]:
    """What changes a step's costs: the model and its settings, the
    devices, the batch and its split, the loss, torch."""
    leaves = [t for t in pytree.tree_leaves(request.inputs) if isinstance(t, Tensor)]
    model = model_key(pipe)
    # The costs are profiled under 'zb_h1' whatever the Auto options (a
    # budget, the cache's path) and virtual_stages: a new budget reads them.
    model["settings"] = {
        k: v for k, v in model["settings"].items() if k not in ("schedule", "virtual_stages")
    }
    return {
        "kind": "schedule costs",
        **model,
        "devices": [str(d) for d in pipe.devices],
        "batch": batch_shape(tuple(leaves)),
        "micro_batches": request.micros,
        "torch": torch.__version__,
        **loss_key(request.loss_fn, request.target),
    }


def _stage_bytes(pipe: Pipe, request: AutoRequest) -> tuple[float, ...]:
    """Each stage's bytes saved for backward per micro-batch: one
    fill-drain step's peak per stage (every micro-batch alive at once),
    over its micro-batches."""
    with scheduled(pipe), untouched(pipe), StageSavedBytes(pipe.partitions) as tracker:
        pipe.schedule, pipe.virtual_stages = "gpipe", None
        pipe._train_step(request.inputs, request.target, request.loss_fn, None, None)
        synchronize(pipe.devices)
    return tuple(b / request.micros for b in tracker.peak_bytes)

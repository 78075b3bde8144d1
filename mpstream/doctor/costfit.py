"""Doctor step 8's fitting and checking, shared by its eager and graphed parts.

A profiled step's per-micro-batch costs are fitted from its fastest run
(:func:`fastest`) and simulated against that run's makespan
(:func:`validate`); per-layer costs are calibrated so each stage sums to the
fit (:func:`calibrate`), a stage's issue time spread over its layers
(:func:`spread_issue`), and the automatic balance over more GPUs prices its
cuts' copies over a link (:func:`balanced_copies`).
"""

from __future__ import annotations

from typing import Any

from ..observe.cost_model import micro_batches, simulate
from ..observe.fitting import Costs, fit
from ..observe.scaling import predict
from ..observe.timeline import Timeline

__all__ = ["scaled", "fastest", "validate", "spread_issue", "calibrate", "balanced_copies"]


def scaled(costs: Costs, factor: float) -> Costs:
    """Costs for micro-batches ``factor`` times as large (linear in the images)."""
    return Costs(
        [(f * factor, b * factor) for f, b in costs.stage_times],
        [(f * factor, b * factor) for f, b in costs.copy_times],
        issue_times=dict(costs.issue_times),
    )


def _step_ms(
    costs: Costs,
    micros: tuple[int, float],
    overlap: bool,
    devices: list[str],
    host: bool = True,
) -> float:
    """The simulated step of ``micros`` (count, last one's relative size)."""
    return simulate(
        costs.stage_times,
        costs.copy_times,
        micros[0],
        last_size=micros[1],
        overlap=overlap,
        backward=True,
        devices=devices,
        # On the CPU the issue times are the compute itself (overlap=False).
        issue_times=costs.issue_times if host and overlap and costs.issue_times else None,
    ).step_ms


def fastest(timeline: Timeline) -> tuple[Timeline, float]:
    """The profiled step with the shortest makespan, and that makespan.

    Interference from other work only ever adds time; costs and makespan then
    come from the same step, so the comparison is not skewed by noise.
    """
    runs = timeline.runs()
    spans = timeline.summary(echo=False).per_run
    best = min(range(len(runs)), key=lambda i: float(spans[i]["makespan_ms"]))
    return timeline.select(runs[best]), float(spans[best]["makespan_ms"])


def validate(
    timelines: dict[int, Timeline],
    main_split: int,
    batch_size: int,
    overlap: bool,
    devices: list[str],
) -> list[dict[str, Any]]:
    """Simulated against measured step at each profiled split size.

    Args:
        timelines: the profile at each split size.
        main_split: the split size whose costs also predict the others (scaled).
        batch_size: images per step.
        overlap: model mpstream's streams (a GPU) or one host thread (the CPU).
        devices: a label per stage (distinct labels model the copies).

    On a GPU (``overlap``) the simulation includes the timeline's host
    issue times; each row also gives it without them (``devices_only_ms``),
    and ``issue_modelled`` says whether they were used. On the CPU the
    issue times are the compute itself and are left out. A batch the split
    size does not divide is fitted and simulated with its shorter last
    micro-batch.
    """
    main = fit(fastest(timelines[main_split])[0], micro_batches(batch_size, main_split)[1])
    rows = []
    for split, timeline in timelines.items():
        micros = micro_batches(batch_size, split)
        step, measured = fastest(timeline)
        costs = fit(step, micros[1])
        predicted = _step_ms(costs, micros, overlap, devices)
        alone = _step_ms(costs, micros, overlap, devices, host=False)
        from_main = _step_ms(scaled(main, split / main_split), micros, overlap, devices)
        rows.append(
            {
                "split_size": split,
                "micro_batches": micros[0],
                "measured_ms": measured,
                "predicted_ms": predicted,
                "error": (predicted - measured) / measured,
                "issue_modelled": overlap and bool(costs.issue_times),
                "devices_only_ms": alone,
                "devices_only_error": (alone - measured) / measured,
                "scaled_from_main_ms": from_main,
                "scaled_error": (from_main - measured) / measured,
            }
        )
    return rows


def spread_issue(balance: list[int], costs: Costs) -> list[tuple[float, float]]:
    """Per-layer issue times: each stage's fitted (forward, backward) issue
    time split evenly over its layers (a stage's kernels, roughly)."""
    out: list[tuple[float, float]] = []
    for s, n in enumerate(balance):
        f = costs.issue_times.get(("forward", s), 0.0)
        b = costs.issue_times.get(("backward", s), 0.0)
        out += [(f / n, b / n)] * n
    return out


def calibrate(
    layer_times: list[tuple[float, float]], balance: list[int], costs: Costs
) -> list[tuple[float, float]]:
    """Per-layer costs scaled so each stage of ``balance`` sums to its fitted cost."""
    out: list[tuple[float, float]] = []
    start = 0
    for n, (fwd, bwd) in zip(balance, costs.stage_times):
        part = layer_times[start : start + n]
        sf = fwd / s if (s := sum(f for f, _ in part)) > 0 else 1.0
        sb = bwd / s if (s := sum(b for _, b in part)) > 0 else 1.0
        out += [(f * sf, b * sb) for f, b in part]
        start += n
    return out


def balanced_copies(
    layer_times: list[tuple[float, float]],
    gpus: int,
    micros: int,
    profiled: list[Any],
    link_gbps: float,
) -> tuple[list[int], list[tuple[float, float]]]:
    """The automatic balance over ``gpus`` devices, and each cut's copy time
    (forward and backward) over a link of ``link_gbps``."""
    balance = predict(layer_times, gpus, micros).balance
    cuts = [sum(balance[: i + 1]) - 1 for i in range(gpus - 1)]
    link_ms = [profiled[c].output_bytes / (link_gbps * 1e6) for c in cuts]
    return balance, [(ms, ms) for ms in link_ms]

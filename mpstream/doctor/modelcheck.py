"""Doctor step 8: the cost model, fitted from step 7's profiles and checked against them.

At each split size step 7 profiled, per-micro-batch task costs are fitted
(:func:`mpstream.simulate_fit`) from the fastest profiled step and the
schedule is simulated with them; the error is the simulated step against
that step's makespan, so it measures what the model leaves out (contention
between streams on one GPU, host work between tasks), not the fit. On a GPU
the fit includes each task's host issue time, which the scheduler measures,
and the simulation has the one host thread issue every task; the devices
alone are reported beside it (on an H100 at the tutorial's sizes they
missed by 43%: the host set the pace). For reference, the main split size's
costs scaled linearly by micro-batch size (issue times unscaled: a task's
kernels are as many whatever its size) also predict the other split sizes
(reported, not judged).

The predictions for 2 and 4 GPUs take each layer's cost on the device
(:func:`~mpstream.stages.balance.profile_layers`), calibrated per stage so the
stages sum to the costs fitted at the main split size, and let
:func:`mpstream.predict` pick the balance. On a GPU each stage's fitted
issue time is spread evenly over its layers, so one host thread issues the
predicted pipelines and the single device alike. They are labelled as
predictions: nothing here was measured on more devices.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..observe.cost_model import simulate
from ..observe.fitting import Costs, fit, issue_spread
from ..observe.scaling import predict
from ..observe.timeline import Timeline
from ..stages import profile_layers
from ..tutorial import models as tutorial
from .diagnosis import FAIL, INFO, PASS, Check, Context, StepResult, overall
from .experiment import config_for

__all__ = [
    "MAX_ERROR",
    "GRAPHED_ERROR",
    "GRAPHED_SPEEDUP",
    "PREDICTED_SCHEDULES",
    "task_issue",
    "graphed_predictions",
    "ASSUMED_LINK_GBPS",
    "scaled",
    "fastest",
    "validate",
    "calibrate",
    "run",
]

# Graphed stages (step 7's second profile): the model within 10% of the
# measured step, and these speed-ups predicted for more GPUs at the main
# split after balance (the graphed-stages issue's targets, reported only).
GRAPHED_ERROR = 0.10
GRAPHED_SPEEDUP = {2: 1.8, 4: 3.2}
#: The schedules the cost model simulates for those predictions.
PREDICTED_SCHEDULES = ("gpipe", "1f1b")
MAX_ERROR = 0.25  # beyond this the model misses something (host issue time, contention)
ASSUMED_LINK_GBPS = 50.0  # the project's default GPU-to-GPU bandwidth, when none is measured


def scaled(costs: Costs, factor: float) -> Costs:
    """Costs for micro-batches ``factor`` times as large (linear in the images)."""
    return Costs(
        [(f * factor, b * factor) for f, b in costs.stage_times],
        [(f * factor, b * factor) for f, b in costs.copy_times],
        issue_times=dict(costs.issue_times),
    )


def _step_ms(
    costs: Costs, micros: int, overlap: bool, devices: list[str], host: bool = True
) -> float:
    return simulate(
        costs.stage_times,
        costs.copy_times,
        micros,
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
    issue times are the compute itself and are left out.
    """
    main = fit(fastest(timelines[main_split])[0])
    rows = []
    for split, timeline in timelines.items():
        micros = math.ceil(batch_size / split)
        step, measured = fastest(timeline)
        costs = fit(step)
        predicted = _step_ms(costs, micros, overlap, devices)
        alone = _step_ms(costs, micros, overlap, devices, host=False)
        from_main = _step_ms(scaled(main, split / main_split), micros, overlap, devices)
        rows.append(
            {
                "split_size": split,
                "micro_batches": micros,
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


def task_issue(balance: list[int], costs: Costs) -> list[tuple[float, float]]:
    """Per-layer issue times for a graphed pipeline: a replayed task costs
    the host about the same whatever its stage holds (copies in, a launch,
    copies out), so the measured per-task mean lands on each stage's first
    layer of ``balance`` and nothing on the others."""

    def mean(kind: str) -> float:
        values = [v for (k, _), v in costs.issue_times.items() if k == kind]
        return sum(values) / len(values) if values else 0.0

    starts = {sum(balance[:s]) for s in range(len(balance))}
    forward, backward = mean("forward"), mean("backward")
    return [(forward, backward) if i in starts else (0.0, 0.0) for i in range(sum(balance))]


def graphed_predictions(
    ctx: Context,
    micros: int,
    profiled: list[Any],
    link_gbps: float,
    labels: list[str],
    checks: list[Check],
) -> dict[str, Any]:
    """The cost model fitted to step 7's graphed-stages profile (GPU only):
    checked against that measured step (target within :data:`GRAPHED_ERROR`)
    and predicting 2 and 4 GPUs, for each of :data:`PREDICTED_SCHEDULES`,
    from the graphed fit's device times (the ``profiled`` layers' costs,
    calibrated to it: an eager fit's task spans hold the host's issue time)
    and its per-task issue times, against one device whose step replays as
    one graph (targets :data:`GRAPHED_SPEEDUP`). Adds its checks; returns
    its figures."""
    profile = ctx.shared.get("graphed_profile")
    if profile is None:
        return {}
    config = config_for(ctx)
    step = fastest(profile["timeline"])[0]
    costs = fit(step)
    spread = issue_spread(step)
    raw = [(p.forward_ms, p.backward_ms) for p in profiled]
    layer_times = calibrate(raw, profile["balance"], costs)
    row = validate(
        {config.split_size: profile["timeline"]}, config.split_size, config.batch_size, True, labels
    )[0]
    met = "met" if abs(row["error"]) <= GRAPHED_ERROR else "missed"
    checks.append(
        Check(
            "cost model, graphed stages (measured one-GPU step)",
            INFO,  # graphed stages are measured against their target, not yet held to it
            f"simulated {row['predicted_ms']:.1f} ms vs measured {row['measured_ms']:.1f} ms: "
            f"{100 * row['error']:+.1f}% (target ±{100 * GRAPHED_ERROR:.0f}%: {met})",
            row,
        )
    )
    out: dict[str, Any] = {"validation": row, "predictions": []}
    # Like with like: the one device a graphed pipeline is held against
    # replays its step as one graph, so only its device time counts.
    graphed_single = micros * sum(f + b for f, b in layer_times)
    for schedule in PREDICTED_SCHEDULES:
        for p in (2, 4):
            balance, copies = balanced_copies(layer_times, p, micros, profiled, link_gbps)
            issue = task_issue(balance, costs) if costs.issue_times else None
            pred = predict(
                layer_times, p, micros, balance=balance, copy_times=copies,
                issue_times=issue, schedule=schedule,
            )  # fmt: skip
            fair = graphed_single / pred.step_ms
            target = GRAPHED_SPEEDUP[p]
            met = "met" if fair >= target else "missed"
            name = f"prediction (not measured): {p} GPUs, graphed stages, {schedule}"
            checks.append(
                Check(
                    f"{name}, balance {pred.balance}",
                    INFO,
                    f"step {pred.step_ms:.1f} ms with the graphed host issue times: "
                    f"{fair:.2f}x one device replayed as one graph, its device time "
                    f"{graphed_single:.1f} ms (target >= {target}x: {met})",
                )
            )
            out["predictions"].append(
                {
                    "gpus": p,
                    "schedule": schedule,
                    "balance": pred.balance,
                    "predicted_step_ms": pred.step_ms,
                    "graphed_single_device_ms": graphed_single,
                    "predicted_speedup": fair,
                }
            )
    if spread:  # the fit's medians beside the launches that did not wait
        checks.append(
            Check(
                "graphed stages: host issue per task (median / min, ms)",
                INFO,
                ", ".join(
                    f"{k} {s}: {m:.2f} / {lo:.2f}" for (k, s), (_, lo, m, _) in spread.items()
                ),
                {"tasks": [[k, s, n, lo, m, hi] for (k, s), (n, lo, m, hi) in spread.items()]},
            )
        )
    return out


def run(ctx: Context) -> StepResult:
    """Fits, checks and predicts from step 7's profiles (needs them)."""
    profiles = ctx.shared["profiles"]
    config = config_for(ctx)
    main = profiles[config.split_size]
    costs = fit(fastest(main["timeline"])[0])
    dev0, dev1 = ctx.devices
    separate = ctx.cuda and (dev0 != dev1 or main["forced_copies"])
    labels = [f"{dev0}/stage0", f"{dev1}/stage1"] if separate else [str(dev0), str(dev1)]
    timelines = {split: p["timeline"] for split, p in profiles.items()}
    rows = validate(timelines, config.split_size, config.batch_size, ctx.cuda, labels)
    checks = []
    for row in rows:
        ok = abs(row["error"]) <= MAX_ERROR
        alone = (
            f"; devices alone {100 * row['devices_only_error']:+.0f}%"
            if row["issue_modelled"]
            else ""
        )
        detail = (
            f"simulated {row['predicted_ms']:.1f} ms vs measured {row['measured_ms']:.1f} ms: "
            f"{100 * row['error']:+.1f}% (limit ±{100 * MAX_ERROR:.0f}%); from split "
            f"{config.split_size}'s costs scaled: {100 * row['scaled_error']:+.0f}%{alone}"
        )
        checks.append(
            Check(f"cost model at split {row['split_size']}", PASS if ok else FAIL, detail, row)
        )

    layers = tutorial.resnet50_layers(tutorial.single_device(ctx.arch, "cpu", config.num_classes))
    images = torch.randn(config.split_size, 3, config.image_w, config.image_h)
    profiled = profile_layers(layers, images, device=dev0, repeat=ctx.sizes.profile_steps)
    layer_times = calibrate(
        [(p.forward_ms, p.backward_ms) for p in profiled], main["balance"], costs
    )
    copy_ms = costs.copy_times[0][0] if costs.copy_times else 0.0
    cut = profiled[main["balance"][0] - 1].output_bytes
    if ctx.two_gpus and copy_ms > 0:
        link_gbps, link = cut / (copy_ms * 1e6), "measured between the two GPUs"
    else:
        link_gbps, link = ASSUMED_LINK_GBPS, "assumed"
    micros = math.ceil(config.batch_size / config.split_size)
    # On the CPU the host's issue time is the compute itself: a GPU would
    # issue the same layers far faster, so predictions leave it out there.
    issue = spread_issue(main["balance"], costs) if ctx.cuda and costs.issue_times else None
    predictions = []
    for p in (2, 4):
        balance, copies = balanced_copies(layer_times, p, micros, profiled, link_gbps)
        link_ms = [c for c, _ in copies]
        pred = predict(
            layer_times, p, micros, balance=balance, copy_times=copies, issue_times=issue
        )
        devices_only = predict(layer_times, p, micros, balance=balance, copy_times=copies)
        predictions.append(
            {
                "gpus": p,
                "balance": pred.balance,
                "predicted_step_ms": pred.step_ms,
                "single_device_ms": pred.single_device_ms,
                "predicted_speedup": pred.speedup,
                "issue_modelled": issue is not None,
                "devices_only_speedup": devices_only.speedup,
                "copy_ms": link_ms,
            }
        )
        host = (
            f"; one host thread issuing every task, as measured (devices alone: "
            f"{devices_only.speedup:.2f}x)"
            if issue is not None
            else ""
        )
        checks.append(
            Check(
                f"prediction (not measured): {p} GPUs, automatic balance {pred.balance}",
                INFO,
                f"step {pred.step_ms:.1f} ms, {pred.speedup:.2f}x one device "
                f"(copies at {link_gbps:.0f} GB/s, {link}{host})",
            )
        )
    graphed = graphed_predictions(ctx, micros, profiled, link_gbps, labels, checks)
    worst = max(rows, key=lambda r: abs(r["error"]))
    figure = (
        "error "
        + ", ".join(f"{100 * r['error']:+.0f}% at split {r['split_size']}" for r in rows)
        + "; predicted "
        + ", ".join(f"{q['gpus']} GPUs {q['predicted_speedup']:.2f}x" for q in predictions)
    )
    status = overall(checks)
    reason = ""
    if status == FAIL:
        missing = (
            "contention between streams and host work between tasks"
            if worst["issue_modelled"]
            else "host issue time (not measured here) or contention between streams"
        )
        reason = (
            f"off by {100 * worst['error']:+.0f}% at split {worst['split_size']}: the model does "
            f"not include {missing} (see step 7)"
        )
    data = {
        "fitted_costs_ms": {
            "stage_times": costs.stage_times,
            "copy_times": costs.copy_times,
            "issue_times": [[k, s, v] for (k, s), v in sorted(costs.issue_times.items())],
        },
        "fitted_at_split": config.split_size,
        "validation": rows,
        "predictions": predictions,
        "graphed": graphed,
        "link_gbps": link_gbps,
        "link": link,
        "layer_ms_calibrated": {q.name: t for q, t in zip(profiled, layer_times)},
        "overlap_modelled": ctx.cuda,
    }
    return StepResult("cost-model", "Cost model", status, figure, reason, checks, data)

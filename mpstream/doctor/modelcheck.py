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

import torch

from ..observe.cost_model import micro_batches
from ..observe.fitting import fit
from ..observe.scaling import predict
from ..stages import profile_layers
from ..tutorial import models as tutorial
from .costfit import balanced_copies, calibrate, fastest, spread_issue, validate
from .diagnosis import FAIL, INFO, PASS, Check, Context, StepResult, overall
from .experiment import config_for
from .graphcost import graphed_predictions

__all__ = ["MAX_ERROR", "ASSUMED_LINK_GBPS", "run"]

MAX_ERROR = 0.25  # beyond this the model misses something (host issue time, contention)
ASSUMED_LINK_GBPS = 50.0  # the project's default GPU-to-GPU bandwidth, when none is measured


def run(ctx: Context) -> StepResult:
    """Fits, checks and predicts from step 7's profiles (needs them)."""
    profiles = ctx.shared["profiles"]
    config = config_for(ctx)
    main = profiles[config.split_size]
    costs = fit(
        fastest(main["timeline"])[0], micro_batches(config.batch_size, config.split_size)[1]
    )
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
    micros, last = micro_batches(config.batch_size, config.split_size)
    # On the CPU the host's issue time is the compute itself: a GPU would
    # issue the same layers far faster, so predictions leave it out there.
    issue = spread_issue(main["balance"], costs) if ctx.cuda and costs.issue_times else None
    predictions = []
    for p in (2, 4):
        balance, copies = balanced_copies(layer_times, p, micros, profiled, link_gbps)
        link_ms = [c for c, _ in copies]
        pred = predict(
            layer_times, p, micros, balance=balance, copy_times=copies, issue_times=issue,
            last_size=last,
        )  # fmt: skip
        devices_only = predict(
            layer_times, p, micros, balance=balance, copy_times=copies, last_size=last
        )
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
        if not ctx.cuda:  # a CPU run predicts GPUs at the CPU's speed: say whose costs
            host = "; the layers' costs measured on this CPU, not on a GPU"
        checks.append(
            Check(
                f"prediction (not measured): {p} GPUs, automatic balance {pred.balance}",
                INFO,
                f"step {pred.step_ms:.1f} ms, {pred.speedup:.2f}x one device "
                f"(copies at {link_gbps:.0f} GB/s, {link}{host})",
            )
        )
    graphed = graphed_predictions(ctx, (micros, last), profiled, link_gbps, labels, checks)
    worst = max(rows, key=lambda r: abs(r["error"]))
    figure = (
        "error "
        + ", ".join(f"{100 * r['error']:+.0f}% at split {r['split_size']}" for r in rows)
        + ("; predicted " if ctx.cuda else "; predicted from the CPU's costs ")
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

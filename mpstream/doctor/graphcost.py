"""Doctor step 8, graphed stages: the cost model on step 7's graphed profile.

Fitted to the profile of the main split with every stage replayed from CUDA
graphs (``Pipe(graphs=True)``), the model is checked against that measured
step (target within :data:`GRAPHED_ERROR`) and predicts 2 and 4 GPUs for
each of :data:`PREDICTED_SCHEDULES`. A replayed task costs the host about
the same whatever its stage holds (:func:`task_issue`). Like with like, the
predictions are held against the single device's step captured as one
graph, as step 7 measured it (:func:`captured_single`). Each task kind's
issue time is reported as the fit's median beside its minimum
(:func:`~mpstream.observe.fitting.issue_spread`). Everything here is
reported, never judged: graphed stages are measured against their targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..observe.fitting import Costs, fit, issue_spread
from ..observe.scaling import predict
from .costfit import balanced_copies, calibrate, fastest, validate
from .diagnosis import INFO, Check, Context
from .experiment import config_for
from .graphed import CAPTURED, SINGLE

__all__ = [
    "GRAPHED_ERROR",
    "GRAPHED_SPEEDUP",
    "PREDICTED_SCHEDULES",
    "task_issue",
    "captured_single",
    "graphed_predictions",
]

# The graphed-stages issue's targets: the model within 10% of the measured
# step, and these speed-ups predicted for more GPUs at the main split after
# balance.
GRAPHED_ERROR = 0.10
GRAPHED_SPEEDUP = {2: 1.8, 4: 3.2}
#: The schedules the cost model simulates for those predictions.
PREDICTED_SCHEDULES = ("gpipe", "1f1b")


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


def captured_single(rows: Sequence[dict[str, Any]] | None) -> float | None:
    """The single device's step captured as one graph (ms), from step 7's
    per-schedule rows, or None where it was not measured."""
    single = next((r for r in rows or () if r.get("schedule") == SINGLE), None)
    captured = (single or {}).get(CAPTURED) or {}
    step = captured.get("step_ms")
    return float(step) if step and not captured.get("error") else None


def graphed_predictions(
    ctx: Context,
    micros: tuple[int, float],
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
    one graph (targets :data:`GRAPHED_SPEEDUP`). ``micros`` is the
    micro-batches' count and the last one's share of a full one
    (:func:`~mpstream.observe.cost_model.micro_batches`). Adds its checks;
    returns its figures."""
    profile = ctx.shared.get("graphed_profile")
    if profile is None:
        return {}
    config = config_for(ctx)
    step = fastest(profile["timeline"])[0]
    count, last = micros  # the last micro-batch's share of a full one
    costs = fit(step, last)
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
    # replays its whole batch's step as one graph, as step 7 measured it.
    # Without that measurement the fit's device time over the micro-batches
    # stands in, which charges one device the micro-batches' narrow kernels.
    measured = captured_single(ctx.shared.get("graphed_schedules"))
    graphed_single = measured or (count - 1 + last) * sum(f + b for f, b in layer_times)
    basis = (
        "the single device's step captured as one graph (measured, SGD included)"
        if measured
        else "one device replaying the micro-batches, its device time from the fit"
    )
    for schedule in PREDICTED_SCHEDULES:
        for p in (2, 4):
            balance, copies = balanced_copies(layer_times, p, count, profiled, link_gbps)
            issue = task_issue(balance, costs) if costs.issue_times else None
            pred = predict(
                layer_times, p, count, balance=balance, copy_times=copies,
                issue_times=issue, schedule=schedule, last_size=last,
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
                    f"{fair:.2f}x {basis}, {graphed_single:.1f} ms (target >= {target}x: {met})",
                )
            )
            out["predictions"].append(
                {
                    "gpus": p,
                    "schedule": schedule,
                    "balance": pred.balance,
                    "predicted_step_ms": pred.step_ms,
                    "graphed_single_device_ms": graphed_single,
                    "baseline_measured": bool(measured),
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

"""``mpstream doctor --model transformer``'s cost model: fitted, checked, asked for more GPUs.

The cost model fitted to the profile :func:`.transformer.profile_step`
took, checked against the measured step and asked for 2, 4 and 8 GPUs
(predictions, labelled so) against the single device and against naive
model parallel, with the memory per device each layout would need. The
transformer issue's targets (:data:`.transformer.TARGETS`) are reported,
never failed: a timing is not a defect.
"""

from __future__ import annotations

from typing import Any

import torch

from ..observe.cost_model import simulate
from ..observe.fitting import fit
from ..observe.scaling import predict
from .costfit import balanced_copies, calibrate, fastest, spread_issue
from .diagnosis import FAIL, INFO, PASS, Check, Context, StepResult, overall
from .transformer import TARGETS, preset_of

__all__ = ["cost_model"]

MAX_ERROR = 0.25  # the cost model's FAIL limit, as for the ResNet
GPU_LAYOUTS = (2, 4, 8)


def cost_model(ctx: Context) -> StepResult:
    """Fits, checks against the measured step, predicts 2/4/8 GPUs."""
    p = preset_of(ctx)
    prof = ctx.shared["transformer_profile"]
    step, measured = fastest(prof["timeline"])
    costs = fit(step)
    m, balance = prof["micros"], prof["balance"]
    dev0, dev1 = ctx.devices
    separate = ctx.cuda and (dev0 != dev1 or prof["forced"])
    labels = [f"{dev0}/stage0", f"{dev1}/stage1"] if separate else [str(dev0), str(dev1)]
    issue = costs.issue_times if ctx.cuda and costs.issue_times else None
    simulated = simulate(
        costs.stage_times,
        costs.copy_times,
        m,
        schedule="1f1b",
        overlap=ctx.cuda,
        backward=True,
        devices=labels,
        issue_times=issue,
    ).step_ms
    error = (simulated - measured) / measured
    checks = [
        Check(
            "cost model against the profiled step",
            PASS if abs(error) <= MAX_ERROR else FAIL,
            f"simulated {simulated:.1f} ms vs measured {measured:.1f} ms: {100 * error:+.1f}% "
            f"(target ±{100 * TARGETS['model_error']:.0f}%, FAIL beyond ±{100 * MAX_ERROR:.0f}%)",
        )
    ]
    layers = prof["layers"]
    layer_times = calibrate([(q.forward_ms, q.backward_ms) for q in layers], balance, costs)
    link = 50.0  # GB/s between GPUs, assumed (the doctor's default)
    host = spread_issue(balance, costs) if issue else None
    rows = []
    for n in GPU_LAYOUTS:
        if n > p.depth:
            continue
        cut, copies = balanced_copies(layer_times, n, m, layers, link)
        pipe = predict(
            layer_times, n, m, balance=cut, copy_times=copies, schedule="1f1b", issue_times=host
        )
        whole = [(f * m, b * m) for f, b in layer_times]
        naive = predict(
            whole,
            n,
            1,
            balance=cut,
            copy_times=[(c * m, d * m) for c, d in copies],
            overlap=False,
            issue_times=host,
        )
        need = _per_device(layers, cut, m)
        rows.append(
            {
                "gpus": n,
                "balance": cut,
                "step_ms": pipe.step_ms,
                "single_device_ms": pipe.single_device_ms,
                "speedup": pipe.speedup,
                "naive_ms": naive.step_ms,
                "vs_naive": naive.step_ms / pipe.step_ms,
                "per_device_bytes": need,
            }
        )
        vs_naive = naive.step_ms / pipe.step_ms
        goals = []
        target = {2: TARGETS["two_gpus"], 4: TARGETS["four_gpus"]}.get(n)
        if target is not None:
            goals.append(f">= {target}x the single device: {_met(pipe.speedup >= target, ctx)}")
        if n == 2:
            vs = TARGETS["two_gpus_vs_naive"]
            goals.append(f">= {vs}x naive: {_met(vs_naive >= vs, ctx)}")
        held = f"at most {_size(max(need))} per device{_fits(max(need), ctx)}"
        checks.append(
            Check(
                f"prediction (not measured): {n} GPUs, 1F1B, balance {cut}",
                INFO,
                f"{pipe.speedup:.2f}x the single device, {vs_naive:.2f}x naive model parallel; "
                f"{held} (parameters, gradients, AdamW, 1F1B's activations)"
                + (f"; targets {', '.join(goals)}" if goals else ""),
            )
        )
    figure = f"error {100 * error:+.0f}%; predicted " + ", ".join(
        f"{r['gpus']} GPUs {r['speedup']:.2f}x" for r in rows
    )
    reason = next((f"{c.name}: {c.detail}" for c in checks if c.status == FAIL), "")
    data = {
        "measured_ms": measured,
        "simulated_ms": simulated,
        "error": error,
        "predictions": rows,
        "link_gbps": link,
        "micro_batches": m,
    }
    return StepResult("cost-model", "Cost model", overall(checks), figure, reason, checks, data)


def _met(ok: bool, ctx: Context) -> str:
    return ("met" if ok else "missed") if ctx.cuda else "a GPU target, from the CPU's costs"


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _fits(nbytes: int, ctx: Context) -> str:
    """Whether that much fits on a device like this run's first."""
    if not ctx.cuda:
        return ""
    total = torch.cuda.get_device_properties(ctx.devices[0]).total_memory
    return f" ({'fits' if nbytes <= 0.9 * total else 'does not fit'} on {_size(total)})"


def _per_device(layers: list[Any], balance: list[int], m: int) -> list[int]:
    """Bytes each device of a 1F1B layout would hold: its layers'
    parameters and gradients (profiled), AdamW's two float32 moments, and
    the activations of the micro-batches it keeps in flight (stage ``s`` of
    ``n``: ``min(n - s, m)``)."""
    out, start = [], 0
    n = len(balance)
    for s, count in enumerate(balance):
        part = layers[start : start + count]
        state = sum(q.parameter_bytes for q in part)  # each parameter and its gradient
        adam = state  # two moments, the size of parameter and gradient together
        acts = sum(q.activation_bytes for q in part) * min(n - s, m)
        out.append(int(state + adam + acts))
        start += count
    return out

"""``mpstream doctor --model transformer``: the steps that measure the transformer workload.

On :mod:`mpstream.workloads`'s decoder: memory per stage, measured, and on
a GPU steady over steps; the bench (:mod:`mpstream.workloads.bench`, the
experiment); and a profiled step and each layer's costs, which
:mod:`.transformer_costs` fits. The run's preset (:func:`preset_of`) and the
transformer issue's targets (:data:`TARGETS`) are the workload's steps'
common ground; correctness and races are :mod:`.transformer_checks`'s. The
targets are reported, never failed: a timing is not a defect.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..observe.profiling import profile
from ..pipe import Pipe
from ..runtime import synchronize
from ..stages import profile_layers
from ..workloads import bench, memory, report, transformer
from .diagnosis import FAIL, INFO, PASS, Check, Context, StepResult, overall
from .graphed import time_steps

__all__ = [
    "memory_step",
    "activation_bound",
    "experiment",
    "profile_step",
    "preset_of",
    "TARGETS",
]

#: The transformer issue's targets (reported, not failed).
TARGETS = {
    "over_single": 1.10,
    "host_share": 0.10,
    "model_error": 0.10,
    "two_gpus": 1.8,
    "two_gpus_vs_naive": 1.7,
    "four_gpus": 3.2,
}


def preset_of(ctx: Context) -> transformer.Preset:
    """The run's preset (the runner chose it: ``--preset``, else 1b at the
    full sizes on a GPU, tiny otherwise)."""
    return transformer.preset(str(ctx.shared.get("preset", "tiny")))


def _autocast(p: transformer.Preset, device: torch.device) -> Any:
    enabled = p.dtype is not None and device.type == "cuda"
    return torch.autocast(device.type, dtype=p.dtype or torch.bfloat16, enabled=enabled)


def memory_step(ctx: Context) -> StepResult:
    """Memory per stage of each schedule at the largest micro-batch count,
    measured; on a GPU, the allocator's peak steady over steps."""
    p = preset_of(ctx)
    m = max(p.micro_batches)
    config = bench.Config(p, ctx.devices, graphed=False, hf=False)
    rows: dict[str, list[dict[str, int]]] = {}
    checks: list[Check] = []
    peaks: dict[str, dict[str, int]] = {}
    for schedule in ("gpipe", "1f1b", "zb_h1"):
        runner = bench._Runner(("mpstream", schedule, m), config)
        runner.step()
        per_stage, device_peaks = memory.per_stage(
            runner.module, runner.opt, runner.step, runner.devices
        )
        rows[schedule], peaks[schedule] = per_stage, device_peaks
        if ctx.cuda:
            checks.append(_steady(schedule, runner.step, runner.devices, ctx.sizes.soak_steps))
        del runner
    g, o = rows["gpipe"][0]["activations"], rows["1f1b"][0]["activations"]
    checks.insert(0, activation_bound(o, g, m, len(rows["gpipe"])))
    for schedule, stages in rows.items():
        text = "; ".join(
            f"stage {s}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in stage.items())
            for s, stage in enumerate(stages)
        )
        checks.append(
            Check(f"{schedule}, {m} micro-batches (measured)", INFO, text, {"stages": stages})
        )
    from ..observe.figures import memory_bars

    title = f"transformer {p.name}, memory per stage, {m} micro-batches"
    memory_bars(rows, ctx.out / "transformer_memory_schedules.png", title)
    ctx.shared["transformer_memory"] = rows
    figure = f"1f1b stage 0 activations {o / 2**20:.1f} MiB vs gpipe {g / 2**20:.1f} MiB"
    reason = next((f"{c.name}: {c.detail}" for c in checks if c.status == FAIL), "")
    data = {"per_stage": rows, "device_peaks": peaks}
    return StepResult(
        "memory",
        "Memory",
        overall(checks),
        figure,
        reason,
        checks,
        data,
        ["transformer_memory_schedules.png"],
    )


def activation_bound(one_f_one_b: int, gpipe: int, micro_batches: int, stages: int) -> Check:
    """1F1B's first stage against gpipe's, in activation bytes held at peak.

    With more micro-batches than stages 1F1B keeps at most ``stages`` of
    them in flight where gpipe keeps all: it must hold strictly fewer.
    Otherwise both hold every micro-batch, and 1F1B must hold no more.
    """
    detail = f"{one_f_one_b / 2**20:.1f} MiB vs {gpipe / 2**20:.1f} MiB"
    if micro_batches > stages:
        ok = one_f_one_b < gpipe
        name = "1F1B holds fewer activations than gpipe on the first stage"
    else:
        ok = one_f_one_b <= gpipe
        name = (
            f"1F1B holds no more activations than gpipe on the first stage "
            f"({micro_batches} micro-batches, {stages} stages: fewer is not expected)"
        )
    return Check(name, PASS if ok else FAIL, detail)


def _steady(schedule: str, step: Callable[[], None], devices: list[torch.device], n: int) -> Check:
    """The allocated memory after each of ``n`` steps: no growth."""
    seen = []
    for _ in range(max(3, n)):
        step()
        synchronize(devices)
        seen.append(sum(torch.cuda.memory_allocated(d) for d in set(devices)))
    grew = seen[-1] - seen[1]
    ok = grew <= 0.01 * seen[1]
    name = f"{schedule}: memory steady over {len(seen)} steps"
    return Check(
        name, PASS if ok else FAIL, f"allocated grew by {grew / 2**20:.1f} MiB", {"allocated": seen}
    )


def experiment(ctx: Context) -> StepResult:
    """The bench of the transformer (see :mod:`mpstream.workloads.bench`)."""
    p = preset_of(ctx)
    if not ctx.cuda:
        p = transformer.preset(p.name, repeat=min(p.repeat, 3), warmup=1)
    config = bench.Config(p, ctx.devices, hf=ctx.cuda)
    keys = bench.keys_for(config)
    with ctx.bar(len(keys) * (p.warmup + p.repeat), "transformer bench") as bar:
        results = bench.run(config, tick=lambda: bar.update(1))
    files = [f.name for f in report.save(results, ctx.out)]
    (ctx.scratch / "transformer_table.txt").write_text(report.table(results) + "\n")
    data = report.to_json(results)
    ctx.shared["transformer_bench"] = data
    eager = [r for r in data["rows"] if r["variant"] == "mpstream" and r["schedule"] == "1f1b"]
    best = min(eager, key=lambda r: r["step_s"]["median"]) if eager else None
    checks = [] if best is None else _headline(best, ctx.cuda)
    checks += _graphed_headline(data["rows"], ctx.cuda)
    for row in data["rows"]:
        mfu = "" if row["mfu"] is None else f", MFU {100 * row['mfu']:.0f}%"
        fell_back = row["ran_eagerly"]  # a graphed row whose capture failed: a defect
        checks.append(
            Check(
                row["configuration"],
                FAIL if fell_back else PASS,
                f"{row['tokens_per_s']:.0f} tokens/s, step {_times(row)}{mfu}"
                + (f"; {fell_back}: an eager step's" if fell_back else ""),
            )
        )
    # A configuration the device cannot hold is a fact of the model's size.
    checks += [Check(row["configuration"], INFO, row["why"]) for row in data["unfit"]]
    where = "" if ctx.cuda else " (CPU: nothing overlaps)"
    figure = (
        f"{p.name}: no 1f1b configuration fit"
        if best is None
        else f"{p.name}: 1f1b {_times(best)} at {best['micro_batches']} micro-batches{where}"
    )
    reason = next((f"{c.name}: {c.detail}" for c in checks if c.status == FAIL), "")
    return StepResult(
        "experiment",
        "Experiment",
        overall(checks),
        figure,
        reason,
        checks,
        data,
        [*files, "transformer_table.txt"],
    )


def _times(row: dict[str, Any]) -> str:
    """A row's step against its like: a graphed row's against the captured
    single device's where that was measured, else against the single
    device's, or naive model parallelism's where the single device could
    not hold the model."""
    if row.get("vs_captured_single_device") is not None:
        return f"{row['vs_captured_single_device']:.2f}x the captured single device's"
    if row["vs_single_device"] is not None:
        return f"{row['vs_single_device']:.2f}x the single device's"
    naive = row["vs_naive_model_parallel"]
    against = "" if naive is None else f"; {naive:.2f}x naive model parallel's"
    return "(the single device could not hold the model)" + against


def _met(ok: bool, cuda: bool) -> str:
    return ("met" if ok else "missed") if cuda else "a GPU target"


def _graphed_headline(rows: list[dict[str, Any]], cuda: bool) -> list[Check]:
    """The fastest graphed-stages row that replayed graphs against the
    single device captured whole (graphed against graphed), if both ran."""
    graphed = [
        r
        for r in rows
        if r["variant"] == bench.GRAPHED
        and not r["ran_eagerly"]
        and r["vs_captured_single_device"] is not None
    ]
    if not graphed:
        return []
    best = min(graphed, key=lambda r: r["step_s"]["median"])
    over, target = best["vs_captured_single_device"], TARGETS["over_single"]
    return [
        Check(
            f"graphed stages at {best['micro_batches']} micro-batches against the captured "
            f"single device",
            INFO,
            f"{over:.2f}x its step (target <= {target}x on one GPU: "
            f"{_met(over <= target, cuda)}); {best['tokens_per_s']:.0f} tokens/s",
        )
    ]


def _headline(best: dict[str, Any], cuda: bool) -> list[Check]:
    """The fastest eager 1F1B row against the targets."""
    over, naive, share = (
        best[k] for k in ("vs_single_device", "vs_naive_model_parallel", "host_issue_share")
    )
    target = TARGETS["over_single"]
    single = (
        "" if over is None else f" (target <= {target}x on one GPU: {_met(over <= target, cuda)})"
    )
    return [
        Check(
            f"1f1b at {best['micro_batches']} micro-batches against the single device",
            INFO,
            f"{_times(best)}{single}"
            + ("" if naive is None or over is None else f"; {naive:.2f}x naive model parallel")
            + f"; {best['tokens_per_s']:.0f} tokens/s",
        ),
        Check(
            "host issue, eager 1f1b",
            INFO,
            f"{100 * share:.0f}% of the step (target <= {100 * TARGETS['host_share']:.0f}%: "
            f"{_met(share <= TARGETS['host_share'], cuda)})",
        ),
    ]


def profile_step(ctx: Context) -> StepResult:
    """A profiled 1F1B step (timeline, bubble, copies hidden, host issue)
    and each layer's costs on one micro-batch, for the cost model."""
    p = preset_of(ctx)
    m = max(p.micro_batches)
    dev0, dev1 = ctx.devices
    force = ctx.cuda and dev0 == dev1
    pipe = Pipe(
        transformer.decoder(p, dev0),
        balance=transformer.halves(p),
        devices=[dev0, dev1],
        chunks=m,
        schedule="1f1b",
        force_copies=force,
    )
    x, y = transformer.tokens(p, dev0)
    y = y.to(dev1)
    with _autocast(p, dev0):
        for _ in range(2):
            pipe.train_step(x, y, transformer.loss_fn)
        synchronize([dev0, dev1])
        with profile(pipe) as prof:
            for _ in range(ctx.sizes.profile_steps):
                pipe.zero_grad()
                pipe.train_step(x, y, transformer.loss_fn)
                synchronize([dev0, dev1])
        sample = x[: math.ceil(p.batch / m)]
        layers = profile_layers(
            transformer.decoder(p, dev0), sample, device=dev0, repeat=ctx.sizes.profile_steps
        )
    prof.plot(
        ctx.out / "transformer_timeline.png", title=f"transformer {p.name}, 1f1b, {m} micro-batches"
    )
    prof.export_chrome_trace(ctx.scratch / "transformer_trace.json")
    summary = prof.summary(echo=False)
    with _autocast(p, dev0):

        def step() -> None:
            pipe.zero_grad()
            pipe.train_step(x, y, transformer.loss_fn)

        timed = time_steps(step, [dev0, dev1], ctx.sizes.profile_steps)
    ctx.shared["transformer_profile"] = {
        "timeline": prof,
        "layers": layers,
        "micros": m,
        "balance": transformer.halves(p),
        "forced": force,
    }
    hidden = summary.copy_hidden_fraction
    copies = "no copies" if hidden is None else f"copies hidden {100 * hidden:.0f}%"
    share = timed["issue_share"]
    where = "" if ctx.cuda else " (CPU: the host runs the stages)"
    figure = (
        f"1f1b, {m} micro-batches: {summary.bubble_text()}, {copies}, "
        f"host issue {100 * share:.0f}% of the step{where}"
    )
    checks = [
        Check(
            "profiled step",
            PASS,
            figure,
            {
                "bubble": summary.bubble_fraction,
                "device_idle": summary.device_idle_fraction,
                **timed,
            },
        ),
        Check("layers profiled for the cost model", PASS, f"{len(layers)} layers, one micro-batch"),
    ]
    return StepResult(
        "profile",
        "Where the time goes",
        PASS,
        figure,
        "",
        checks,
        {},
        ["transformer_timeline.png", "transformer_trace.json"],
    )

"""A transformer bench's results (:mod:`.bench`) as figures, JSON, a table and plots.

Per configuration: tokens per second, the ratio to each baseline (graphed
stages' also to the single device captured as one graph), model FLOPs
utilisation against the summed dense bf16 peaks of the devices it uses
(:func:`mfu`), the
host's issue share of the step and memory per stage. :func:`save` writes the
JSON and two figures. On the CPU nothing overlaps: the figures and the table
say CPU, and no speed-up is claimed.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import torch

from ..tutorial import rounds
from .bench import CAPTURED, GRAPHED, NAIVE, SINGLE, Key, Measured, Results, label, on_one_device
from .transformer import flops_per_token

__all__ = ["mfu", "to_json", "noisy_spreads", "table", "save"]


def mfu(results: Results, key: Key) -> float | None:
    """Model FLOPs utilisation: the step's FLOPs over the time at peak of
    the devices the configuration uses, their peaks summed (each device
    once: both halves on one GPU count it once; the single device's
    configurations count the first device only). None where any of them
    has no known peak."""
    known: dict[str, float | None] = results.meta.get("peak_tflops") or {}
    used = {str(d) for d in _devices(results, key)}
    if not all(known.get(d) for d in used):
        return None
    peak = sum(float(known[d] or 0) for d in used)
    p = results.config.preset
    achieved = flops_per_token(p) * p.tokens / results.measured[key].median
    return achieved / (peak * 1e12)


def _devices(results: Results, key: Key) -> list[torch.device]:
    dev0, dev1 = results.config.devices
    return [dev0] if on_one_device(key[0]) else [dev0, dev1]


def to_json(results: Results) -> dict[str, Any]:
    """Everything measured, with the derived figures; a ratio to a
    baseline that did not fit is None (``unfit`` says why), and so is the
    ratio to the captured single device of every configuration but graphed
    stages (the captured single device's own is against the eager one), and
    every ratio to it where its own capture failed (it then timed an eager
    step: ``ran_eagerly`` says why)."""
    p = results.config.preset
    baselines = [results.measured.get((v, None, None)) for v in (SINGLE, NAIVE, CAPTURED)]
    if baselines[2] is not None and baselines[2].eager:
        # Graphed against eager is not like with like, which the table's
        # note and the doctor's graphed headline would claim it is.
        baselines[2] = None
    rows = []
    for key, m in results.measured.items():
        issue = statistics.median(m.issue) if m.issue else None
        against: list[Measured | None] = list(baselines)
        if key[0] != GRAPHED:
            against[2] = None  # eager against graphed is not like with like
        single, naive, captured = (None if b is None else m.median / b.median for b in against)
        rows.append(
            {
                "configuration": label(key), "variant": key[0], "schedule": key[1],
                "micro_batches": key[2], "group": m.group,
                "step_s": {"median": m.median, "min": min(m.times), "max": max(m.times),
                           "rounds": m.times, "spread": m.spread.to_json()},
                # A ratio is as noisy as the noisier of its measurements.
                "ratio_noisy": any(x.spread.noisy for x in (m, *against) if x is not None),
                "tokens_per_s": results.tokens_per_s(key),
                "vs_single_device": single, "vs_naive_model_parallel": naive,
                "vs_captured_single_device": captured,
                "mfu": mfu(results, key),
                "host_issue_share": None if issue is None else issue / m.median,
                "memory_per_stage": m.memory,
                "peak_allocated_per_device": m.device_peaks,
                "ran_eagerly": m.eager or None,
            }
        )  # fmt: skip
    preset = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(p).items()}
    return {
        "meta": results.meta,
        "preset": preset,
        "devices": [str(d) for d in results.config.devices],
        "flops_per_token": flops_per_token(p),
        "cpu": all(d.type == "cpu" for d in results.config.devices),
        "rows": rows,
        "unfit": [{"configuration": label(k), "why": why} for k, why in results.unfit.items()],
        "interrupted": results.interrupted,
        "not_timed": [label(k) for k in results.not_timed()],
        "noisy": list(noisy_spreads(results)),
    }


def noisy_spreads(results: Results) -> dict[str, rounds.Spread]:
    """The noisy configurations by name, each with its spread."""
    spreads = {label(k): m.spread for k, m in results.measured.items()}
    return {name: s for name, s in spreads.items() if s.noisy}


def table(results: Results) -> str:
    """The comparison as text: a graphed configuration's ``x single`` is
    against the captured single device (like with like)."""
    data = to_json(results)
    lines = [
        f"{'configuration':<44} {'step ms':>9} {'tokens/s':>10} {'x single':>8} "
        f"{'x naive':>8} {'MFU':>6} {'host':>5}"
    ]
    for row in data["rows"]:
        mfu_ = "-" if row["mfu"] is None else f"{100 * row['mfu']:.0f}%"
        host = "-" if row["host_issue_share"] is None else f"{100 * row['host_issue_share']:.0f}%"
        star = "*" if row["ratio_noisy"] else " "
        graphed = row["variant"] == GRAPHED
        single, naive = (
            "-" if row[k] is None else f"{row[k]:.2f}{star}"
            for k in (
                "vs_captured_single_device" if graphed else "vs_single_device",
                "vs_naive_model_parallel",
            )
        )
        lines.append(
            f"{row['configuration']:<44} {1e3 * row['step_s']['median']:>9.1f} "
            f"{row['tokens_per_s']:>10.0f} {single:>9}{naive:>9}{mfu_:>6} {host:>5}"
        )
    # The tutorial's table (mpstream bench) gives speed-ups, above 1 faster;
    # these are ratios of step times, the other way round: say which.
    lines.append(
        "step ms: the median training step (forward, loss, backward, AdamW); x single, x naive: "
        "its time over the single device's and over naive model parallel's (below 1: faster)"
    )
    if any(row["mfu"] is not None for row in data["rows"]):
        known = ", ".join(f"{d} {peak}" for d, peak in data["meta"]["peak_tflops"].items())
        lines.append(
            "MFU: against the dense bf16 peaks of the devices a configuration uses, summed, "
            f"each device once ({known} TFLOP/s)"
        )
    lines += [
        f"{row['configuration']:<44} {'does not fit in device memory even alone':>52}"
        for row in data["unfit"]
    ]
    if any(row["vs_captured_single_device"] is not None for row in data["rows"]):
        lines.append(
            f"x single of {GRAPHED}: against the {CAPTURED} (its whole step one CUDA "
            f"graph), graphed against graphed"
        )
    if data["cpu"]:
        lines.append(
            "CPU: every stage runs on the host thread one task after another; nothing "
            "overlaps, and no pipeline can be faster here (ratios show the runtime's cost)"
        )
    lines += [
        f"! {row['configuration']}: {row['ran_eagerly']}: an eager step's times, not graphed"
        for row in data["rows"]
        if row["ran_eagerly"]
    ]
    lines += [f"! {row['configuration']}: {row['why']}" for row in data["unfit"]]
    if data["interrupted"]:
        repeat = results.config.preset.repeat
        short = [r["configuration"] for r in data["rows"] if len(r["step_s"]["rounds"]) < repeat]
        said = [f"fewer than {repeat} rounds: {', '.join(short)}"] if short else []
        said += [f"not timed: {', '.join(data['not_timed'])}"] if data["not_timed"] else []
        lines.append(
            "! interrupted: the figures are what ran before it"
            + "".join(f"; {part}" for part in said)
        )
    lines += rounds.noise_lines(noisy_spreads(results), results.meta.get("load", {}))
    return "\n".join(lines)


def save(results: Results, out: Path, *, plots: bool = True) -> list[Path]:
    """Writes ``transformer.json`` and, with ``plots``, the two figures (an
    earlier run's figures in ``out`` are removed either way)."""
    out.mkdir(parents=True, exist_ok=True)
    data = to_json(results)
    path = out / "transformer.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    written = [path]
    # An earlier run's figures would sit beside this run's numbers.
    for name in ("transformer_throughput.png", "transformer_memory.png"):
        (out / name).unlink(missing_ok=True)
    if plots and data["rows"]:  # an interrupt before any timed round: nothing to draw
        from ..observe.figures import memory_bars, throughput_curves

        where = "CPU (no overlap possible)" if data["cpu"] else ", ".join(data["devices"])
        p = results.config.preset
        title = f"transformer {p.name}, {p.batch} x {p.seq} tokens per step, {where}"
        curves: dict[str, tuple[list[int], list[float]]] = {}
        flat: dict[str, float] = {}
        for row in data["rows"]:
            if row["micro_batches"] is None:
                flat[row["variant"]] = row["tokens_per_s"]
                continue
            name = label((row["variant"], row["schedule"], None)).split(",")[0]
            xs, ys = curves.setdefault(name, ([], []))
            xs.append(row["micro_batches"])
            ys.append(row["tokens_per_s"])
        written.append(throughput_curves(curves, flat, out / "transformer_throughput.png", title))
        bars = {
            row["configuration"]: row["memory_per_stage"]
            for row in data["rows"]
            if row["micro_batches"] in (None, max(p.micro_batches))
        }
        written.append(memory_bars(bars, out / "transformer_memory.png", title))
    return written

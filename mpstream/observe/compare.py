"""Schedules side by side: simulated step and bubble, live activations,
measured memory, and one picture with a timeline per schedule.

A research tool built on the core: :func:`compare` simulates every schedule
with the same stage costs on the same devices (stages placed contiguously,
round-robin for interleaved 1F1B, compute of stages sharing a device run one
at a time); :func:`live_activations` counts, from a schedule's order, the
micro-batches each stage holds; :func:`measure_memory` runs a real step per
schedule and records the bytes autograd saved per stage (CPU) or the
allocator's peak per device (GPU); :func:`split_cost` times a split backward
against a plain one. Each row also counts the graph launches of a step
captured per device in segments. ``mpstream schedules`` prints and plots it all.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..memory import StageSavedBytes
from ..pipe import Pipe
from ..runtime import GradSink, backward_inputs, cut, synchronize
from ..schedules import SCHEDULES, Kind, Schedule, segment
from .cost_model import Cost, Costs, Simulation, fit, simulate
from .profiling import profile
from .timeline import COMPUTE, Timeline

__all__ = [
    "Comparison",
    "live_activations",
    "placement",
    "device_bubble",
    "compare",
    "table",
    "plot_stacked",
    "profile_stages",
    "measure_memory",
    "split_cost",
]

_KIND_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "weight": "#937860"}


def live_activations(schedule: Schedule) -> tuple[list[int], list[int]]:
    """Per stage, the most micro-batches it holds at once, by issue order.

    Returns:
        ``(live, held)``: ``live[s]`` counts micro-batches whose forward ran
        on stage ``s`` and whose backward (its input pass, when split) did
        not: the activations a backward reads. ``held[s]`` counts those
        whose last backward pass (the weight pass, when split) did not run:
        what a micro-batch keeps until its parameter gradients are done.
    """
    live = [0] * schedule.stages
    held = [0] * schedule.stages
    now_live = [0] * schedule.stages
    now_held = [0] * schedule.stages
    for t in schedule.tasks:
        s = t.stage
        if t.kind is Kind.FORWARD:
            now_live[s] += 1
            now_held[s] += 1
        elif t.kind is Kind.BACKWARD:
            now_live[s] -= 1
            if (s, t.micro) not in schedule.split:
                now_held[s] -= 1
        elif t.kind is Kind.WEIGHT:
            now_held[s] -= 1
        else:
            continue
        live[s] = max(live[s], now_live[s])
        held[s] = max(held[s], now_held[s])
    return live, held


def placement(stages: int, devices: int, schedule: str) -> list[str]:
    """Device labels of the stages: round-robin for interleaved 1F1B (its
    ranks), contiguous runs of stages otherwise."""
    if schedule == "interleaved_1f1b":
        return [f"device{s % devices}" for s in range(stages)]
    return [f"device{s * devices // stages}" for s in range(stages)]


def device_bubble(timeline: Timeline) -> float:
    """Share of device-time (devices x step) in which a device computed nothing."""
    spans = [s for s in timeline.spans if s.kind in COMPUTE]
    if not spans:
        return 0.0
    start = min(s.start_ms for s in timeline.spans)
    step = max(s.end_ms for s in timeline.spans) - start
    by_device: dict[str, list[tuple[float, float]]] = {}
    for s in spans:
        by_device.setdefault(timeline.stream_devices[s.stream], []).append((s.start_ms, s.end_ms))
    busy = 0.0
    for intervals in by_device.values():
        end = -float("inf")
        for a, b in sorted(intervals):
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
    return 1.0 - busy / (len(by_device) * step) if step > 0 else 0.0


@dataclass
class Comparison:
    """One schedule, simulated (and possibly measured).

    Attributes:
        schedule: its name.
        step_ms: simulated step time.
        bubble_fraction: simulated idle share of the devices' time.
        live: per stage, peak micro-batches between forward and backward.
        held: per stage, peak micro-batches between forward and the last
            backward pass (W for split backwards).
        devices: the device label of each stage.
        simulation: the simulated step (its timeline).
        launches: graph launches of a step captured per device in segments
            (``CapturedStep(groups=...)``): the segments, prologue, epilogue.
        measured: per stage, peak bytes saved for backward in a real step
            (CPU), or per device the allocator's peak (GPU); empty if not
            measured.
    """

    schedule: str
    step_ms: float
    bubble_fraction: float
    live: list[int]
    held: list[int]
    devices: list[str]
    simulation: Simulation
    launches: int = 0
    measured: dict[str, int] = field(default_factory=dict)


def compare(
    stage_times: Sequence[Cost],
    devices: int,
    micros: int,
    *,
    copy_times: float = 0.0,
    schedules: Sequence[str] = SCHEDULES,
) -> list[Comparison]:
    """Simulates each schedule with the same stage costs on the same devices.

    Args:
        stage_times: per stage, (forward, backward) or (forward, input_grad,
            weight_grad) per micro-batch, in milliseconds.
        devices: how many devices the stages share.
        micros: micro-batches per step.
        copy_times: time of each copy between devices.
        schedules: which schedules.

    Returns:
        One :class:`Comparison` per schedule.

    Raises:
        ValueError: fewer stages than devices, or (for interleaved 1F1B)
            stages that are not a multiple of the devices.
    """
    stages = len(stage_times)
    if devices < 1 or stages < devices:
        raise ValueError(f"{stages} stages cannot use {devices} devices (one stage at least each)")
    out = []
    for name in schedules:
        labels = placement(stages, devices, name)
        virtual = stages // devices if name == "interleaved_1f1b" else None
        if virtual is not None and stages % devices:
            raise ValueError(
                f"interleaved_1f1b places stages round-robin: {stages} stages do not divide "
                f"evenly over {devices} devices"
            )
        sim = simulate(
            stage_times,
            copy_times,
            micros,
            name,
            devices=labels,
            virtual_stages=virtual,
            share_compute=True,
        )
        sched = Schedule(
            name, stages, micros, [False] * stages, backward=True, virtual_stages=virtual or 1
        )
        live, held = live_activations(sched)
        launches = segment(sched, [labels.index(d) for d in labels]).launches + 2
        bubble = device_bubble(sim.timeline)
        out.append(Comparison(name, sim.step_ms, bubble, live, held, labels, sim, launches))
    return out


def table(rows: Sequence[Comparison]) -> str:
    """A Markdown table of the comparison."""
    measured = any(r.measured for r in rows)
    head = "| schedule | step (ms) | bubble | live per stage | held per stage | launches |"
    rule = "| --- | ---: | ---: | --- | --- | ---: |"
    if measured:
        head += " measured peak (MB) |"
        rule += " --- |"
    lines = [head, rule]
    for r in rows:
        line = (
            f"| {r.schedule} | {r.step_ms:.1f} | {100 * r.bubble_fraction:.1f}% | "
            f"{' '.join(map(str, r.live))} | {' '.join(map(str, r.held))} | {r.launches} |"
        )
        if measured:
            line += " " + " ".join(f"{b / 2**20:.1f}" for b in r.measured.values()) + " |"
        lines.append(line)
    return "\n".join(lines)


def plot_stacked(rows: Sequence[Comparison], path: str | Path, title: str = "") -> Path:
    """One PNG: a timeline per schedule (a row per device), on one time axis."""
    from matplotlib.patches import Patch

    from .figures import pyplot, save

    plt = pyplot()
    devices = max(len(set(r.devices)) for r in rows)
    fig, axes = plt.subplots(
        len(rows), 1, sharex=True, figsize=(11, 0.5 + len(rows) * (0.45 * devices + 0.7))
    )
    axes = list(axes) if len(rows) > 1 else [axes]
    width = max(r.step_ms for r in rows)
    for ax, r in zip(axes, rows):
        timeline = r.simulation.timeline
        labels = list(dict.fromkeys(r.devices))
        for span in timeline.spans:
            if span.kind not in _KIND_COLORS:
                continue
            y = labels.index(timeline.stream_devices[span.stream])
            # Stages sharing a device alternate in shade.
            shade = 1.0 - 0.4 * (r.devices[: span.stage].count(r.devices[span.stage]) % 2)
            ax.broken_barh(
                [(span.start_ms, span.duration_ms)],
                (y - 0.4, 0.8),
                facecolors=_KIND_COLORS[span.kind],
                alpha=shade,
                edgecolor="white",
                linewidth=0.4,
            )
            if span.duration_ms > width / 90:
                ax.text(
                    span.start_ms + span.duration_ms / 2,
                    y,
                    str(span.micro),
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white",
                )
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(
            f"{r.schedule}: step {r.step_ms:.1f} ms, bubble {100 * r.bubble_fraction:.1f}%",
            fontsize=8,
            loc="left",
        )
    axes[-1].set_xlabel("time (ms, simulated)")
    axes[-1].set_xlim(0, width * 1.01 if width > 0 else 1)
    axes[0].legend(
        handles=[Patch(color=c, label=k) for k, c in _KIND_COLORS.items()],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
        ncol=3,
        frameon=False,
    )
    if title:
        fig.suptitle(title, fontsize=9, x=0.01, ha="left")
    return save(fig, axes[-1], Path(path))


def _step(pipe: Pipe, x: Any, y: Any, loss_fn: Callable[[Any, Any], Tensor]) -> None:
    pipe.zero_grad(set_to_none=True)
    pipe.train_step(x, y, loss_fn)
    synchronize(pipe.devices)


def profile_stages(
    pipe: Pipe, x: Any, y: Any, loss_fn: Callable[[Any, Any], Tensor], steps: int = 2
) -> Costs:
    """Per-stage costs of ``pipe`` measured under ``'zb_h1'``, so the
    forward, input-gradient and weight-gradient passes are timed apart.

    Returns:
        The fitted costs; ``costs.per_stage()`` are (forward, input_grad,
        weight_grad) triples. ``pipe.schedule`` is restored.
    """
    previous, pipe.schedule = pipe.schedule, "zb_h1"
    try:
        _step(pipe, x, y, loss_fn)  # warm-up
        with profile(pipe) as prof:
            for _ in range(steps):
                _step(pipe, x, y, loss_fn)
    finally:
        pipe.schedule = previous
    return fit(prof)


def measure_memory(
    pipe: Pipe,
    x: Any,
    y: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    schedules: Sequence[str] = SCHEDULES,
    virtual_stages: int | None = None,
) -> dict[str, dict[str, int]]:
    """The memory of one training step per schedule, after a warm-up step.

    On a GPU: ``torch.cuda.max_memory_allocated`` per device. Elsewhere: per
    stage, the peak bytes its forwards saved for backward
    (:class:`~mpstream.memory.StageSavedBytes`).

    Returns:
        Per schedule, ``{"stage0": bytes, ...}`` or ``{"cuda:0": bytes, ...}``.
    """
    previous = (pipe.schedule, pipe.virtual_stages)
    out: dict[str, dict[str, int]] = {}
    gpus = sorted({d for d in pipe.devices if d.type == "cuda"}, key=str)
    try:
        for name in schedules:
            pipe.schedule = name
            pipe.virtual_stages = virtual_stages if name == "interleaved_1f1b" else None
            _step(pipe, x, y, loss_fn)
            if gpus:
                for d in gpus:
                    torch.cuda.reset_peak_memory_stats(d)
                _step(pipe, x, y, loss_fn)
                out[name] = {str(d): torch.cuda.max_memory_allocated(d) for d in gpus}
            else:
                with StageSavedBytes(pipe.partitions) as tracker:
                    _step(pipe, x, y, loss_fn)
                out[name] = {f"stage{s}": b for s, b in enumerate(tracker.peak_bytes)}
    finally:
        pipe.schedule, pipe.virtual_stages = previous
    return out


def split_cost(stage: nn.Module, sample: Tensor, repeat: int = 5) -> dict[str, float]:
    """Times a stage's split backward (B, then W) against its plain backward.

    Each round runs both on fresh forwards, back to back, after a warm-up
    round; the ratio is the median of the rounds' ratios, so a burst of load
    on a shared machine hits both sides of a round alike. The stage's input
    is cut as in a pipeline, so B has input gradients to compute.

    Returns:
        Medians in milliseconds (``backward_ms``, ``input_ms``,
        ``weight_ms``) and ``ratio``: (B + W) / backward.
    """
    device = sample.device

    def clock() -> float:
        synchronize([device])
        return time.perf_counter()

    def once(split: bool) -> tuple[float, float]:
        sink = GradSink()
        (x,) = cut(sink, (sample,))
        out = stage(x)
        grad = torch.ones_like(out)
        t0 = clock()
        if split:
            weight = backward_inputs([out], [grad])
            t1 = clock()
            weight.run()
        else:
            torch.autograd.backward([out], [grad])
            t1 = clock()
        t2 = clock()
        stage.zero_grad(set_to_none=True)
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3

    plain: list[float] = []
    inputs: list[float] = []
    weights: list[float] = []
    ratios: list[float] = []
    for i in range(repeat + 1):
        if i % 2:  # each goes first every other round
            a, b = once(False), once(True)
        else:
            b = once(True)
            a = once(False)
        if i:  # the first round warms up
            plain.append(a[0])
            inputs.append(b[0])
            weights.append(b[1])
            ratios.append((b[0] + b[1]) / a[0] if a[0] > 0 else float("nan"))
    return {
        "backward_ms": statistics.median(plain),
        "input_ms": statistics.median(inputs),
        "weight_ms": statistics.median(weights),
        "ratio": statistics.median(ratios),
    }

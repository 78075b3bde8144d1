"""Schedules side by side: simulated step and device idle share, live activations,
measured memory, and one picture with a timeline per schedule.

A research tool built on the core: :func:`compare` simulates every schedule
with the same stage costs on the same devices (stages placed contiguously,
round-robin or in a V as each schedule needs, compute of stages sharing a
device run one at a time); :func:`live_activations` counts, from a schedule's order, the
micro-batches each stage holds; :func:`measure_memory` runs a real step per
schedule and records the bytes autograd saved per stage (CPU) or the
allocator's peak per device (GPU); :func:`split_cost` times a split backward
against a plain one (those two and :func:`profile_stages`, what a real pipe
measures, live in :mod:`.measuring`). Each row also counts the graph
launches of a step captured over graphed stages. ``mpstream schedules``
prints and plots it all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .._words import count_of
from ..schedules import (
    SCHEDULES,
    Kind,
    Order,
    Schedule,
    peak_activations,
    placement_of,
    rank_devices,
)
from .cost_model import Cost, Simulation, simulate
from .measuring import label, measure_memory, profile_stages, split_cost

__all__ = [
    "Comparison",
    "graph_launches",
    "live_activations",
    "placement",
    "left_out",
    "compare",
    "table",
    "plot_stacked",
    # What a real pipe measures (:mod:`.measuring`), offered beside the simulation.
    "profile_stages",
    "measure_memory",
    "split_cost",
    "label",
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


def graph_launches(schedule: Schedule, devices: int) -> int:
    """Graph launches of one step of ``schedule`` captured over graphed stages.

    Each forward, backward and weight task replays its stage's graph for its
    micro-batch, and each of the ``devices`` devices launches two more: its
    ``zero_grad`` graph and its optimizer-step graph. Copies between stages
    are not graph launches and are not counted. The first stage's input
    needs no gradient (``train_step`` detaches the batch), so where its
    backward is split, B has nothing to compute and W alone replays.
    """
    compute = (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)
    idle = sum(
        t.kind is Kind.BACKWARD and t.stage == 0 and (0, t.micro) in schedule.split
        for t in schedule.tasks
    )
    return sum(t.kind in compute for t in schedule.tasks) - idle + 2 * devices


def placement(
    stages: int, devices: int, schedule: Order, order_placement: str = "stage"
) -> list[str]:
    """Device labels of the stages: round-robin or a V for the schedules of
    several stages per rank (their ranks), contiguous runs of stages
    otherwise; an order of actions' as ``order_placement`` says
    (:func:`~mpstream.schedules.rank_devices`).

    Raises:
        ValueError: the stages do not fit the schedule's placement.
    """
    built_in = isinstance(schedule, str) and schedule in SCHEDULES
    return rank_devices(schedule, stages, devices, None if built_in else order_placement)


def left_out(stages: int, devices: int, schedules: Sequence[str] = SCHEDULES) -> dict[str, str]:
    """The schedules whose placement ``stages`` stages on ``devices``
    devices cannot take, and why."""
    out = {}
    for name in schedules:
        try:
            rank_devices(name, stages, devices)
        except ValueError as exc:
            out[name] = str(exc)
    return out


@dataclass
class Comparison:
    """One schedule, simulated (and possibly measured).

    Attributes:
        schedule: its name (``'your order'`` for an order of actions).
        step_ms: simulated step time.
        device_idle_fraction: simulated share of device-time (devices x
            step) in which no stage on a device computed, as
            :attr:`~mpstream.observe.summary.Summary.device_idle_fraction`
            (not its per-stage ``bubble_fraction``).
        live: per stage, peak micro-batches between forward and backward.
        held: per stage, peak micro-batches between forward and the last
            backward pass (W for split backwards).
        devices: the device label of each stage.
        simulation: the simulated step (its timeline).
        launches: graph launches of a step captured over graphed stages
            (:func:`graph_launches`).
        peak: per device, the most stage activations (one stage's of one
            micro-batch each) its stages hold at once, until their last
            backward pass, from the issue order.
        measured: per stage, peak bytes saved for backward in a real step
            (CPU: ``"stage0"``), and per CUDA device the allocator's peak
            (``"cuda:0"``); empty if not measured.
    """

    schedule: str
    step_ms: float
    device_idle_fraction: float
    live: list[int]
    held: list[int]
    devices: list[str]
    simulation: Simulation
    launches: int = 0
    measured: dict[str, int] = field(default_factory=dict)
    peak: list[float] = field(default_factory=list)


def compare(
    stage_times: Sequence[Cost],
    devices: int,
    micros: int,
    *,
    copy_times: float = 0.0,
    schedules: Sequence[Order] = SCHEDULES,
    order_placement: str = "stage",
) -> list[Comparison]:
    """Simulates each schedule with the same stage costs on the same devices.

    Args:
        stage_times: per stage, (forward, backward) or (forward, input_grad,
            weight_grad) per micro-batch, in milliseconds.
        devices: how many devices the stages share.
        micros: micro-batches per step.
        copy_times: time of each copy between devices.
        schedules: which schedules: names, or an order of actions (named
            ``'your order'``).
        order_placement: how an order's stages sit on the devices:
            ``'stage'`` (contiguous runs), or ``'round_robin'`` or ``'v'``
            for an order written for several stages per rank, placed as
            the built-in schedules of that placement place theirs.

    Returns:
        One :class:`Comparison` per schedule.

    Raises:
        ValueError: fewer stages than devices, or stages that do not fit a
            schedule's placement (see :func:`left_out`).
    """
    stages = len(stage_times)
    if devices < 1 or stages < devices:
        raise ValueError(
            f"{count_of(stages, 'stage')} cannot use {count_of(devices, 'device')} (one stage at "
            f"least each)"
        )
    out = []
    for name in schedules:
        labels = placement(stages, devices, name, order_placement)
        kind = placement_of(name)
        virtual = {"round_robin": stages // devices, "v": 2}.get(kind)
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
            name, stages, micros, [False] * stages, backward=True, virtual_stages=virtual
        )
        live, held = live_activations(sched)
        launches = graph_launches(sched, len(set(labels)))
        idle = sim.timeline.summary(echo=False).device_idle_fraction
        peak = list(peak_activations(sched, [1.0] * stages, labels).values())
        out.append(
            Comparison(label(name), sim.step_ms, idle, live, held, labels, sim, launches, peak=peak)
        )
    return out


def table(rows: Sequence[Comparison]) -> str:
    """A Markdown table of the comparison.

    Measured peaks (when any row has them) are labelled with what each was
    measured on, ``stage0 3.0, cuda:1 12.5`` (MiB): a pipe with stages on
    the CPU and on GPUs has a figure per CPU stage and per GPU, so a bare
    list of numbers would not say which is which.
    """
    measured = any(r.measured for r in rows)
    head = (
        # Simulated from the costs on devices that need not exist here, beside
        # the measured peaks: said in the column, as docs/schedules.md shows it.
        # The idle share is the devices' (stages sharing one idle it only when
        # none computes), not the per-stage bubble `mpstream trace` prints.
        "| schedule | step (ms, simulated) | device idle | live per stage | held per stage "
        "| peak per device "
        "| launches |"
    )
    rule = "| --- | ---: | ---: | --- | --- | --- | ---: |"
    if measured:
        # Bytes over 2**20: MiB, as the docs and every other report say.
        head += " measured peak (MiB) |"
        rule += " --- |"
    lines = [head, rule]
    for r in rows:
        line = (
            f"| {r.schedule} | {r.step_ms:.1f} | {100 * r.device_idle_fraction:.1f}% | "
            f"{' '.join(map(str, r.live))} | {' '.join(map(str, r.held))} | "
            f"{' '.join(f'{p:g}' for p in r.peak)} | {r.launches} |"
        )
        if measured:
            peaks = ", ".join(f"{key} {b / 2**20:.1f}" for key, b in r.measured.items())
            line += f" {peaks} |"
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
        idle = 100 * r.device_idle_fraction
        ax.set_title(
            f"{r.schedule}: step {r.step_ms:.1f} ms, device idle {idle:.1f}%",
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

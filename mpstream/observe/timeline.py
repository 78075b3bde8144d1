"""Per-stream timelines of pipeline tasks: summaries, Chrome traces, Gantt charts.

A :class:`Timeline` is a list of :class:`Span` (one task on one stream) from
either a measured run (:func:`mpstream.profile`) or the cost model
(:func:`mpstream.simulate`); both get the same summary, trace and plot.
"""

from __future__ import annotations

import bisect
import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .summary import Summary

__all__ = ["Span", "Timeline", "COMPUTE", "COPIES", "merge_spans"]

COMPUTE = ("forward", "backward", "weight")
COPIES = ("copy", "copy_grad", "target")
_COLORS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "weight": "#937860",
    "copy": "#55A868",
    "copy_grad": "#C44E52",
    "target": "#8172B3",
}


@dataclass(frozen=True)
class Span:
    """One task: what it did, on which stream, and when (milliseconds)."""

    stage: int
    micro: int
    kind: str
    stream: str
    start_ms: float
    end_ms: float
    run: int = 1
    peer: int = -1  # a copy's receiving stage (default: the next one)
    issue_ms: float = 0.0  # host time spent issuing it (0: not measured)

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms

    @property
    def stages(self) -> tuple[int, ...]:
        """The stages whose devices this task runs on (both ends of a copy)."""
        peer = self.peer if self.peer >= 0 else self.stage + 1
        if self.kind == "copy":
            return tuple(s for s in (self.stage, peer) if s >= 0)
        if self.kind == "copy_grad":
            return (peer, self.stage)
        return (self.stage,)


def _label(span: Span) -> str:
    """A task's name in traces: kind, stage (both ends of a copy), micro-batch."""
    if span.kind in ("copy", "copy_grad"):
        src, dst = span.stages[0], span.stages[-1]
        source = f"s{src}" if span.stage >= 0 else "input"
        return f"{span.kind} {source}->s{dst} mb{span.micro}"
    return f"{span.kind} s{span.stage} mb{span.micro}"


def merge_spans(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intervals merged where they overlap or touch, in order."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _length(intervals: Sequence[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(a: float, b: float, union: Sequence[tuple[float, float]]) -> float:
    """How long ``[a, b]`` overlaps ``union`` (sorted, disjoint intervals)."""
    total = 0.0
    # The first interval that ends after a: ends are increasing, as the starts are.
    i = bisect.bisect_right(union, a, key=lambda iv: iv[1])
    while i < len(union) and union[i][0] < b:
        x, y = union[i]
        total += max(0.0, min(b, y) - max(a, x))
        i += 1
    return total


@dataclass
class Timeline:
    """Tasks on streams.

    Attributes:
        spans: the tasks.
        stream_devices: device name of each stream, in row order.
        source: ``'measured'`` or ``'simulated'``.
        meta: free-form description (devices, torch version, parameters).
    """

    spans: list[Span]
    stream_devices: dict[str, str]
    source: str = "measured"
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def streams(self) -> list[str]:
        return list(self.stream_devices)

    @property
    def stages(self) -> int:
        return 1 + max((max(s.stages) for s in self.spans), default=-1)

    def check_readable(self) -> None:
        """Raises where the spans are not in yet: a timeline has them, a
        profile from the end of its ``with`` block.

        Raises:
            RuntimeError: a profile read inside its block.
        """

    def runs(self) -> list[int]:
        """The run numbers recorded, from 1 (a run that raised left none)."""
        return sorted({s.run for s in self.spans})

    def select(self, run: int) -> Timeline:
        """The spans of one run.

        Args:
            run: a number from :meth:`runs`.

        Returns:
            A timeline of that run's spans alone.
        """
        return Timeline(
            [s for s in self.spans if s.run == run], self.stream_devices, self.source, self.meta
        )

    def stream_busy(self) -> dict[str, float]:
        """Milliseconds each stream was busy in a run: the union of its spans,
        median over runs. Streams with no work are left out."""
        spans: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for s in self.spans:
            spans.setdefault((s.stream, s.run), []).append((s.start_ms, s.end_ms))
        out = {}
        for stream in self.streams:
            per_run = [_length(merge_spans(spans.get((stream, r), []))) for r in self.runs()]
            if any(per_run):
                out[stream] = statistics.median(per_run)
        return out

    def _run_summary(self, spans: list[Span], stages: int) -> dict[str, Any]:
        start = min(s.start_ms for s in spans)
        makespan = max(s.end_ms for s in spans) - start
        compute = {
            st: merge_spans(
                (s.start_ms, s.end_ms) for s in spans if s.kind in COMPUTE and s.stage == st
            )
            for st in range(stages)
        }
        busy = [_length(compute[st]) for st in range(stages)]
        bubble = 1.0 - sum(busy) / (stages * makespan) if makespan > 0 and stages else 0.0
        # Each stage's device (its compute stream's, else the stage itself).
        where = {
            s.stage: self.stream_devices.get(s.stream) or f"stage{s.stage}"
            for s in spans
            if s.kind in COMPUTE
        }
        on: dict[str, list[int]] = {}
        for st, device in where.items():
            on.setdefault(device, []).append(st)
        device_busy = sum(
            _length(merge_spans(iv for st in group for iv in compute[st])) for group in on.values()
        )
        # No compute span at all (copies only): no device computed, so they
        # idled all along, as the bubble (1.0) says; not 0, "never idle".
        idle = 1.0 - device_busy / (len(on) * makespan) if makespan > 0 and on else bubble
        copies = [s for s in spans if s.kind in COPIES]
        copy_total = sum(s.duration_ms for s in copies)
        hidden: float | None = None
        if copies and copy_total > 0:
            # A copy is hidden while any stage on its source or destination
            # device computes.
            near: dict[frozenset[str], list[tuple[float, float]]] = {}
            covered = 0.0
            for c in copies:
                devices = frozenset(where.get(st, f"stage{st}") for st in c.stages)
                if devices not in near:
                    near[devices] = merge_spans(
                        iv for d in devices for st in on.get(d, []) for iv in compute[st]
                    )
                covered += _overlap(c.start_ms, c.end_ms, near[devices])
            hidden = covered / copy_total
        return {
            "makespan_ms": makespan,
            "bubble_fraction": bubble,
            "device_idle_fraction": idle,
            "devices": len(on),
            "copy_hidden_fraction": hidden,
            "stage_busy_ms": busy,
        }

    def summary(self, *, echo: bool = True) -> Summary:
        """Bubble fraction (per stage and per device), hidden copy fraction
        and per-stage busy time.

        Args:
            echo: also print the summary.

        Returns:
            The summary (averaged over runs; ``per_run`` holds each run's).

        Raises:
            ValueError: the timeline is empty.
            RuntimeError: a profile read inside its ``with`` block.
        """
        self.check_readable()
        if not self.spans:
            raise ValueError("the timeline is empty: nothing was recorded")
        stages = self.stages
        per_run = [
            self._run_summary([s for s in self.spans if s.run == r], stages) for r in self.runs()
        ]
        hidden = [
            r["copy_hidden_fraction"] for r in per_run if r["copy_hidden_fraction"] is not None
        ]
        result = Summary(
            makespan_ms=statistics.fmean(r["makespan_ms"] for r in per_run),
            bubble_fraction=statistics.fmean(r["bubble_fraction"] for r in per_run),
            copy_hidden_fraction=statistics.fmean(hidden) if hidden else None,
            stage_busy_ms=[
                statistics.fmean(r["stage_busy_ms"][st] for r in per_run) for st in range(stages)
            ],
            runs=len(per_run),
            per_run=per_run,
            device_idle_fraction=statistics.fmean(r["device_idle_fraction"] for r in per_run),
            devices=max(r["devices"] for r in per_run),
        )
        if echo:
            print(result)
        return result

    def chrome_trace(self) -> dict[str, Any]:
        """The timeline as a Chrome trace: one process per device, one thread per stream."""
        self.check_readable()
        devices = list(dict.fromkeys(self.stream_devices.values()))
        pid = {d: i for i, d in enumerate(devices)}
        tid = {s: i for i, s in enumerate(self.stream_devices)}
        events: list[dict[str, Any]] = []
        for d in devices:
            events.append({"name": "process_name", "ph": "M", "pid": pid[d], "args": {"name": d}})
        for s, d in self.stream_devices.items():
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": pid[d],
                    "tid": tid[s],
                    "args": {"name": s},
                }
            )
            events.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": pid[d],
                    "tid": tid[s],
                    "args": {"sort_index": tid[s]},
                }
            )
        for span in self.spans:
            events.append(
                {
                    "name": _label(span),
                    "cat": span.kind,
                    "ph": "X",
                    "ts": span.start_ms * 1e3,
                    "dur": max(span.duration_ms, 0.0) * 1e3,
                    "pid": pid[self.stream_devices[span.stream]],
                    "tid": tid[span.stream],
                    "args": {"stage": span.stage, "micro": span.micro, "run": span.run},
                }
            )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"source": self.source, **self.meta},
        }

    def export_chrome_trace(self, path: str | Path) -> Path:
        """Writes the Chrome-trace JSON (loadable in Perfetto or chrome://tracing).

        Args:
            path: the JSON file to write.

        Returns:
            ``path``, as a ``Path``.
        """
        out = Path(path)
        out.write_text(json.dumps(self.chrome_trace()))
        return out

    def plot(self, path: str | Path, *, title: str | None = None, run: int | None = None) -> Path:
        """Draws a Gantt chart: one row per stream, bars labelled by micro-batch.

        Args:
            path: the image to write, its format from its suffix (``.png``
                added to a name without one).
            title: the figure title (default: what the timeline is).
            run: only this run (default: the last one).

        Returns:
            The file written: ``path``, or ``path`` with ``.png`` added.

        Raises:
            ValueError: the timeline is empty, has no run ``run``, or
                ``path`` is a folder.
            RuntimeError: a profile read inside its ``with`` block.
        """
        self.check_readable()
        if not self.spans:
            raise ValueError("the timeline is empty: nothing was recorded")
        if run is not None and run not in self.runs():
            # Runs count from 1, and a run that raised left none.
            raise ValueError(f"the timeline has no run {run}; its runs: {self.runs()}")
        from matplotlib.patches import Patch

        from .figures import pyplot, save

        plt = pyplot()

        chosen = run if run is not None else self.runs()[-1]
        spans = [s for s in self.spans if s.run == chosen]
        rows = [s for s in self.stream_devices if any(sp.stream == s for sp in spans)]
        t0 = min(s.start_ms for s in spans)
        width = max(s.end_ms for s in spans) - t0
        fig, ax = plt.subplots(figsize=(11, 0.55 * len(rows) + 1.6))
        for y, stream in enumerate(rows):
            for s in (sp for sp in spans if sp.stream == stream):
                ax.broken_barh(
                    [(s.start_ms - t0, s.duration_ms)],
                    (y - 0.4, 0.8),
                    facecolors=_COLORS.get(s.kind, "grey"),
                    edgecolor="white",
                    linewidth=0.5,
                )
                if s.duration_ms > width / 80:
                    ax.text(
                        s.start_ms - t0 + s.duration_ms / 2,
                        y,
                        str(s.micro),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white",
                    )
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(rows, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("time (ms)")
        ax.set_xlim(0, width * 1.01 if width > 0 else 1)
        kinds = [k for k in _COLORS if any(s.kind == k for s in spans)]
        ax.legend(
            handles=[Patch(color=_COLORS[k], label=k) for k in kinds],
            loc="lower right",
            bbox_to_anchor=(1.0, 1.0),
            fontsize=8,
            ncol=len(kinds),
            frameon=False,
        )
        heading = title or f"{self.source} timeline (run {chosen}); numbers are micro-batches"
        # The legend takes the row just above the plot; the title goes above it,
        # so a long title cannot run into the legend.
        return save(fig, ax, Path(path), heading, loc="left", pad=24)

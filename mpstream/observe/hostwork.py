"""Where the host's time goes in a training step, per task.

On a fast GPU a pipeline is paced by the one host thread that issues its
work: a replayed stage graph needs tens of microseconds to launch, but what
Python, autograd and the event plan do around each launch is paid per task
too. :func:`host_breakdown` runs a step under ``torch.profiler`` and gives
every microsecond of each host thread to the innermost event running then,
sorted into the kinds below, so the per-task cost splits into what can be
removed (Python, the autograd engine) and what cannot (the launch itself).

- ``graph launch``: ``cudaGraphLaunch`` (a replayed graph);
- ``kernel launch``: an eager kernel's launch, memcpy or memset;
- ``event record/wait``: ``cudaEventRecord``, ``cudaStreamWaitEvent`` and
  the like (the event plan);
- ``synchronize``: the host waiting on a device (a stream, event or device
  synchronize);
- ``other CUDA API``: every other CUDA runtime or driver call;
- ``aten``: PyTorch operators' own host work (the dispatcher, CPU kernels);
- ``autograd``: the autograd engine and its nodes, outside the operators
  they call;
- ``mpstream``: Python inside mpstream's ``record_function`` ranges
  (``mpstream/<kind>/stage<s>/mb<m>``), outside everything above;
- ``python``: the step's thread outside any event (the rest of Python);
- ``waiting``: the step's thread outside any event while another thread
  works (``loss.backward()`` blocked on autograd's device threads).

A launch that takes much longer than the rest (:data:`BLOCKED_US`) is
counted as blocked: CUDA's launch queue was full, so the host waited for
the device, and the step is device-bound there. Profiling slows the host
(a few microseconds per event): the same steps are also timed without the
profiler (:attr:`Breakdown.issue_us`), and the kinds are best read as
shares of :attr:`Breakdown.profiled_us`.

Threads: the kinds count every host thread (the user's loop runs its
backward on autograd's device threads, while the step's thread waits),
so they can sum to more than the profiled step. A CUDA call that torch's
profiler links to no operator (the autograd engine's own stream waits, say)
is put on the thread that ends the profile, the step's: such time is
counted there, not on the thread that made the call.
"""

from __future__ import annotations

import heapq
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch._C._autograd import DeviceType
from torch.profiler import ProfilerActivity, record_function

from ..runtime import synchronize
from .timeline import merge_spans

__all__ = ["BLOCKED_US", "KINDS", "Breakdown", "Interval", "attribute", "host_breakdown", "kind_of"]

#: The kinds of host time, in the order tables list them.
KINDS = (
    "graph launch",
    "kernel launch",
    "event record/wait",
    "synchronize",
    "other CUDA API",
    "aten",
    "autograd",
    "mpstream",
    "python",
    "waiting",
)
#: A launch longer than this (µs) waited on a full launch queue.
BLOCKED_US = 200.0
_STEP = "mpstream/host/step"
# An autograd node: AddmmBackward0, a custom Function's ReplayBackward, AccumulateGrad.
_NODE = re.compile(r"(Backward\d*|AccumulateGrad)$")
_GRAPH = ("cudaGraphLaunch", "cuGraphLaunch")
_KERNEL = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cudaMemcpy",
           "cudaMemset", "cuMemcpy", "cuMemset")  # fmt: skip
_EVENT = ("cudaEventRecord", "cudaStreamWaitEvent", "cudaEventQuery", "cudaEventCreate",
          "cudaEventDestroy", "cuEventRecord", "cuStreamWaitEvent", "cuEventQuery")  # fmt: skip
_SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
         "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize")  # fmt: skip


def kind_of(name: str) -> str | None:
    """The kind of host time of a profiler event named ``name`` (None: a
    range that only contains others, such as the step's own)."""
    if name.startswith(_GRAPH):
        return "graph launch"
    if name.startswith(_SYNC):
        return "synchronize"
    if name.startswith(_KERNEL):
        return "kernel launch"
    if name.startswith(_EVENT):
        return "event record/wait"
    if name.startswith("cuda") or (name.startswith("cu") and name[2:3].isupper()):
        return "other CUDA API"
    if name.startswith("autograd::") or _NODE.search(name):
        return "autograd"
    if name.startswith("mpstream/host/"):
        return None
    if name.startswith("mpstream/"):
        return "mpstream"
    if "::" in name:  # aten::, mpstream::, cudnn:: ... operators
        return "aten"
    return None


@dataclass(frozen=True)
class Interval:
    """One profiler event on the host: its thread, its span (µs) and kind."""

    thread: int
    start: float
    end: float
    kind: str | None
    name: str = ""


def attribute(
    intervals: Iterable[Interval], steps: Sequence[tuple[float, float]], main: int
) -> dict[str, float]:
    """Host µs of each kind over the ``steps`` (spans on thread ``main``).

    Each moment of a thread belongs to the innermost event of a kind
    running then (the one that started last); a moment of ``main`` inside a
    step but in no such event is ``python``, or ``waiting`` while another
    thread is in one. Other threads count only where they are in an event
    that overlaps a step. Kinds with no time are left out. The kinds other
    than ``waiting`` sum to the host's busy time over every thread; with
    ``waiting``, to more than the steps' span when another thread worked.
    """
    by_thread: dict[int, list[Interval]] = {main: []}
    for iv in intervals:
        # A range of no kind (a user's own, mpstream's step) is transparent:
        # its time goes to what runs inside it, or to what runs around it.
        if iv.end > iv.start and iv.kind is not None:
            by_thread.setdefault(iv.thread, []).append(iv)
    out: dict[str, float] = {}
    elsewhere: list[tuple[float, float]] = []  # other threads in an event
    idle: list[tuple[float, float]] = []  # the main thread in none
    for thread, ivs in by_thread.items():
        for start, end, kind in _innermost(ivs, steps if thread == main else ()):
            for s0, s1 in steps:
                lo, hi = max(start, s0), min(end, s1)
                if hi <= lo:
                    continue
                if kind is not None:
                    out[kind] = out.get(kind, 0.0) + hi - lo
                    if thread != main:
                        elsewhere.append((lo, hi))
                elif thread == main:
                    idle.append((lo, hi))
    waited = _overlap(merge_spans(idle), merge_spans(elsewhere))
    out["python"] = sum(e - s for s, e in idle) - waited
    out["waiting"] = waited
    return {k: v for k, v in out.items() if v > 0}


def _innermost(
    ivs: Sequence[Interval], fill: Sequence[tuple[float, float]] = ()
) -> list[tuple[float, float, str | None]]:
    """The thread's time cut into pieces at every event's start and end (and
    at the ends of the spans ``fill``), each piece given the kind of the
    event that started last among those running (None: no event, or one
    of no kind)."""
    marks = sorted({t for iv in ivs for t in (iv.start, iv.end)} | {t for f in fill for t in f})
    order = sorted(range(len(ivs)), key=lambda i: ivs[i].start)
    # (-start, end, index): the latest start on top, the shorter first on a tie.
    heap: list[tuple[float, float, int]] = []
    pieces: list[tuple[float, float, str | None]] = []
    nxt = 0
    for a, b in zip(marks, marks[1:]):
        while nxt < len(order) and ivs[order[nxt]].start <= a:
            i = order[nxt]
            heapq.heappush(heap, (-ivs[i].start, ivs[i].end, i))
            nxt += 1
        while heap and heap[0][1] <= a:  # ended; one ended below the top waits its turn
            heapq.heappop(heap)
        pieces.append((a, b, ivs[heap[0][2]].kind if heap else None))
    return pieces


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The time two sorted lists of disjoint spans share (one pass over both)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass
class Breakdown:
    """What :func:`host_breakdown` measured, per step.

    Attributes:
        tasks: the tasks of one step the caller named (replayed or eager).
        steps: how many steps were profiled (and timed).
        issue_us: median host time to issue a step, without the profiler.
        step_us: median time of a step to the devices' end, without it.
        profiled_us: median host time of a profiled step (the step's thread).
        kinds: host µs per step of each kind (see the module docstring).
        counts: per step, how many graph launches, kernel launches, event
            records/waits, synchronizes and operators the profiler saw.
        launch_us: per launch kind, the median, 99th percentile and longest
            launch (µs).
        blocked: launches per step longer than :data:`BLOCKED_US`.
    """

    tasks: int
    steps: int
    issue_us: float
    step_us: float
    profiled_us: float
    kinds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    launch_us: dict[str, dict[str, float]] = field(default_factory=dict)
    blocked: float = 0.0

    def per_task(self) -> dict[str, float]:
        """Host µs of each kind per task, over every thread (see the module
        on threads: with ``waiting``, more than a task's share of the step
        when another thread worked)."""
        return {k: v / self.tasks for k, v in self.kinds.items()}

    def to_json(self) -> dict[str, Any]:
        """Everything, plus the per-task figures, as plain values."""
        return {
            "tasks": self.tasks, "steps": self.steps, "issue_us": self.issue_us,
            "step_us": self.step_us, "issue_share": self.issue_us / self.step_us,
            "profiled_us": self.profiled_us, "kinds_us_per_step": self.kinds,
            "kinds_us_per_task": self.per_task(), "counts_per_step": self.counts,
            "launch_us": self.launch_us, "blocked_per_step": self.blocked,
        }  # fmt: skip


def host_breakdown(
    step: Callable[[], Any],
    tasks: int,
    *,
    steps: int = 5,
    warmup: int = 3,
    devices: Sequence[torch.device] = (),
    trace: str | None = None,
) -> Breakdown:
    """Profiles ``step`` and splits its host time by kind.

    ``step`` runs ``warmup`` times, then ``steps`` times timed without the
    profiler (host issue time, and time to the devices' end), then
    ``steps`` times under ``torch.profiler`` (CPU activity, and CUDA's
    where ``devices`` are GPUs).

    Args:
        step: one training step (a ``train_step``, or the user's loop body).
        tasks: the tasks one step runs (a stage's forward or backward on one
            micro-batch, a weight task), to divide by.
        steps: steps timed, and steps profiled.
        warmup: steps run first (captures, autotuning, allocator).
        devices: the GPUs the step runs on, synchronized around each step.
        trace: a path to write the profiled steps' Chrome trace to.

    Returns:
        A :class:`Breakdown`.

    Raises:
        ValueError: ``tasks`` or ``steps`` below 1, or ``warmup`` below 0.
    """
    if tasks < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"host_breakdown: tasks and steps must be >= 1 and warmup >= 0, got "
                         f"tasks={tasks}, steps={steps}, warmup={warmup}")  # fmt: skip
    gpus = [torch.device(d) for d in devices if torch.device(d).type == "cuda"]
    sync = partial(synchronize, gpus)
    for _ in range(warmup):
        step()
    sync()
    issue, whole = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        issue.append(time.perf_counter() - t0)
        sync()
        whole.append(time.perf_counter() - t0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpus else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(_STEP):
                step()
            sync()
    if trace is not None:
        prof.export_chrome_trace(trace)
    return _summarize(prof.events(), tasks, steps, statistics.median(issue) * 1e6,
                      statistics.median(whole) * 1e6)  # fmt: skip


def _summarize(events: Any, tasks: int, steps: int, issue: float, whole: float) -> Breakdown:
    host = [e for e in events if e.device_type == DeviceType.CPU]
    spans = [(e.time_range.start, e.time_range.end, e.thread) for e in host if e.name == _STEP]
    main = spans[0][2] if spans else 0
    windows = [(s, e) for s, e, _ in spans]
    intervals = [
        Interval(e.thread, e.time_range.start, e.time_range.end, kind_of(e.name), e.name)
        for e in host
        if e.name != _STEP
    ]
    kinds = {k: v / steps for k, v in attribute(intervals, windows, main).items()}
    inside = [iv for iv in intervals if any(s <= iv.start < e for s, e in windows)]
    counts: dict[str, float] = {}
    durations: dict[str, list[float]] = {}
    for iv in inside:
        if iv.kind in ("graph launch", "kernel launch", "event record/wait", "synchronize"):
            counts[iv.kind] = counts.get(iv.kind, 0) + 1 / steps
        if iv.kind in ("graph launch", "kernel launch"):
            durations.setdefault(iv.kind, []).append(iv.end - iv.start)
    # Operators the user's code called (not those inside other operators).
    tops = [e for e in host if e.name != _STEP and kind_of(e.name) == "aten"
            and (e.cpu_parent is None or kind_of(e.cpu_parent.name) != "aten")]  # fmt: skip
    counts["operators"] = len(tops) / steps
    launch = {
        k: {"median": statistics.median(v), "p99": _quantile(v, 0.99), "max": max(v)}
        for k, v in durations.items()
    }
    blocked = sum(d > BLOCKED_US for v in durations.values() for d in v) / steps
    profiled = statistics.median(e - s for s, e in windows) if windows else 0.0
    return Breakdown(tasks, steps, issue, whole, profiled, kinds, counts, launch, blocked)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

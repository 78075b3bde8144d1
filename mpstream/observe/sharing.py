"""Stages that share a device computing at once: the cost model's event-driven replay.

:func:`~mpstream.observe.cost_model.simulate` replays most schedules in one
pass, each task taking its cost. When stages sharing a device may compute
at once on their own streams (a V placement's two stages, say), how long a
task takes depends on what else runs beside it, which a task issued later
may decide; :func:`play` then replays the tasks event by event instead.

Each task waits, as in the one-pass replay, for the earlier tasks of each
stream it occupies, for its dependencies and for the host to begin issuing
it, and ends no earlier than the host finishes issuing it. A stream a task
only orders (``after``: a forced copy's receiving stream) is not waited for
to start it, but the task is done only once that stream has finished its
earlier tasks, and that stream's later tasks wait for it. Compute tasks of
one device share its throughput: a stage's kernels fill ``fill`` of the
device, so ``k`` tasks at once each run at full speed while ``k * fill <=
1``, and otherwise each at ``1 / (k * fill)`` of it (with ``fill=1`` two
tasks at once take twice as long each: the device does the same work per
second, whichever stream it comes from). A forward of ``F`` and a backward
of ``B`` started together on one device have both ended after ``max(F, B)
+ (2 fill - 1) min(F, B)`` (for ``fill`` of at least one half): DualPipe's
"F&B".
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..schedules import Kind, Task

__all__ = ["Job", "play", "replay", "sharing_of"]

_EPS = 1e-9


@dataclass(frozen=True)
class Job:
    """One task to replay.

    Attributes:
        streams: the streams it occupies, each running its tasks in issue order.
        device: the device whose compute it shares; None for a copy.
        work: its time alone on the device.
        deps: indices of the jobs it waits for.
        issued: when the host begins issuing it.
        issue_end: when the host has issued it.
        after: streams ordered after it that it does not run on.
    """

    streams: tuple[str, ...]
    device: str | None
    work: float
    deps: tuple[int, ...]
    issued: float = 0.0
    issue_end: float = 0.0
    after: tuple[str, ...] = ()


def play(jobs: Sequence[Job], fill: float) -> list[tuple[float, float]]:
    """Start and end of each job, the jobs given in issue order.

    Args:
        jobs: the tasks, in the order the host issues them.
        fill: the share of its device one compute job fills, in (0, 1].

    Returns:
        ``(start, end)`` per job.

    Raises:
        ValueError: ``fill`` outside (0, 1].
        RuntimeError: the jobs wait on each other (a dependency issued
            after its dependent), which no schedule produces.
    """
    if not 0.0 < fill <= 1.0:
        raise ValueError(f"a compute task fills a share of its device in (0, 1], got {fill}")
    queues: dict[str, deque[int]] = {}
    for i, job in enumerate(jobs):
        for s in job.streams + job.after:
            queues.setdefault(s, deque()).append(i)
    dependents: list[list[int]] = [[] for _ in jobs]
    waiting = [len(set(job.deps)) for job in jobs]
    for i, job in enumerate(jobs):
        for d in set(job.deps):
            dependents[d].append(i)
    start = [-1.0] * len(jobs)
    end = [-1.0] * len(jobs)
    left = [job.work for job in jobs]
    running: set[int] = set()
    held: list[int] = []  # run, waiting for the streams ordered after them
    now, finished = 0.0, 0
    while finished < len(jobs):
        for q in queues.values():
            i = q[0] if q else -1
            if i >= 0 and start[i] < 0 and not waiting[i] and jobs[i].issued <= now + _EPS:
                if all(queues[s][0] == i for s in jobs[i].streams):
                    start[i] = now
                    running.add(i)
        rates = _rates(jobs, running, left, fill)
        upcoming = [now + left[i] / rates[i] for i in running if left[i] > _EPS]
        upcoming += [jobs[i].issue_end for i in running if left[i] <= _EPS]
        upcoming += [
            jobs[q[0]].issued
            for q in queues.values()
            if q and start[q[0]] < 0 and not waiting[q[0]] and jobs[q[0]].issued > now
        ]
        if not upcoming:
            raise RuntimeError(
                "the tasks wait on each other: a dependency is issued after its task"
            )
        later = max(min(upcoming), now)
        for i in running:
            if left[i] > _EPS:
                left[i] = max(0.0, left[i] - rates[i] * (later - now))
                if left[i] / rates[i] <= _EPS * max(1.0, later):
                    left[i] = 0.0  # rounding: it ends now
        now = later
        for i in sorted(running):
            if left[i] <= _EPS and jobs[i].issue_end <= now + _EPS:
                running.discard(i)
                for s in jobs[i].streams:
                    queues[s].popleft()
                held.append(i)
        while True:  # one done may let another be done at the same time
            done = [i for i in held if all(queues[s][0] == i for s in jobs[i].after)]
            if not done:
                break
            for i in done:
                held.remove(i)
                end[i] = max(now, jobs[i].issue_end)
                finished += 1
                for s in jobs[i].after:
                    queues[s].popleft()
                for j in dependents[i]:
                    waiting[j] -= 1
    return list(zip(start, end))


def _rates(
    jobs: Sequence[Job], running: set[int], left: list[float], fill: float
) -> dict[int, float]:
    """How fast each running job progresses: compute jobs on one device
    share it once together they would fill more than all of it."""
    busy: dict[str, int] = {}
    for i in running:
        device = jobs[i].device
        if device is not None and left[i] > _EPS:
            busy[device] = busy.get(device, 0) + 1
    rates = {}
    for i in running:
        device = jobs[i].device
        k = busy.get(device, 0) if device is not None else 0
        rates[i] = 1.0 / (k * fill) if k * fill > 1.0 else 1.0
    return rates


def sharing_of(devices: Sequence[str], share_compute: bool | float | None) -> bool | float:
    """How stages on one device share its compute: True (one at a time),
    False (each as if alone) or the share of the device one stage fills;
    by default True where two stages share a device (``devices``: a label
    per stage), whichever schedule or order places them there.

    Raises:
        ValueError: a number outside (0, 1].
    """
    if share_compute is None:
        return len(set(devices)) < len(devices)
    if isinstance(share_compute, bool):
        return share_compute
    fill = float(share_compute)
    if not 0.0 < fill <= 1.0:
        raise ValueError(
            f"share_compute must be True, False or the share of a device one stage fills, in "
            f"(0, 1]; got {share_compute!r}"
        )
    return fill


def replay(
    tasks: list[Task],
    streams: Any,
    cost: Any,
    issue: Any,
    devs: list[str],
    shared: bool | float,
    after: Any = lambda t: (),
) -> list[tuple[float, float, float]]:
    """(start, end, host issue time) of each task, in issue order: in one
    pass when each task takes its cost, event by event (:func:`play`) when
    stages on one device compute at once.

    Args:
        tasks: the schedule's tasks, in issue order.
        streams: task -> the streams it occupies (compute tasks: their
            stage's stream, and with ``shared`` True their device's).
        cost: task -> its time alone.
        issue: task -> the host's time to issue it.
        devs: the device label of each stage.
        shared: what :func:`sharing_of` says.
        after: task -> the streams ordered after it that it does not run
            on (a forced copy's receiving copy stream).
    """
    free: dict[str, float] = defaultdict(float)
    end: dict[int, float] = {}
    out = []
    jobs = []
    host = 0.0  # when the issuing thread is free
    for t in tasks:
        on, ordered = streams(t), after(t)
        issued = host
        issuing = issue(t)
        host += issuing
        if isinstance(shared, float):
            compute = t.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)
            device = devs[t.stage] if compute else None
            jobs.append(Job(on, device, cost(t), tuple(t.deps), issued, host, ordered))
            out.append((0.0, 0.0, issuing))
            continue
        start = max([free[s] for s in on] + [end[d] for d in t.deps] + [issued])
        stop = max(start + cost(t), host)
        for s in on:
            free[s] = stop
        # Done once the streams ordered after it are past their earlier work.
        end[t.index] = max([stop] + [free[s] for s in ordered])
        for s in ordered:
            free[s] = end[t.index]
        out.append((start, end[t.index], issuing))
    if jobs:
        # Task indices are issue positions (tasks issue in index order).
        index = {t.index: i for i, t in enumerate(tasks)}
        jobs = [replace(j, deps=tuple(index[d] for d in j.deps)) for j in jobs]
        played = play(jobs, shared)
        out = [(a, b, issuing) for (a, b), (_, _, issuing) in zip(played, out)]
    return out

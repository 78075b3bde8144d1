"""A cost model of pipelined execution: predicted step time and timeline.

:func:`simulate` replays a schedule (the same task lists the C++ scheduler
issues) on modelled streams. Each stream runs its tasks in issue order; a
task starts when its streams are free and its dependencies have finished.

- ``overlap=True`` models mpstream: a compute stream per stage, and each copy
  on the copy streams of both its devices. A copy forced between stages on
  one device (``force_copies``) runs on its sender's copy stream alone; the
  receiver's copy stream waits for it, and the copy is done once that
  stream has also finished what was issued on it before.
- ``overlap=False`` models the tutorial's default-stream pipeline: one stream
  per device, copies block both devices' streams, and within a clock cycle
  later stages are issued first, as the tutorial's loop does.
- ``share_compute=True`` (the default wherever stages share a device, for
  a built-in schedule and an explicit order alike) models stages that share
  a device as sharing its compute: their tasks run one at a time, in issue
  order.
- ``share_compute=fill``, a number in (0, 1], lets them compute at once on
  their own streams, as mpstream's stage streams do on a GPU, each filling
  that share of the device: a busy device computes whatever any of its
  streams has ready, at ``1.0`` no faster in all than one stage alone
  (:mod:`.sharing`).

Every schedule is modelled, explicit orders included. A split backward's
input pass (B) and weight pass (W) cost what the stage costs give; from a
(forward, backward) pair, half the backward each. A whole backward costs a
pair's backward, a triple's B + W, or a quadruple's own last entry: a
schedule that splits only some backwards (``'dualpipev'``) runs the others
as one autograd pass, which costs less than B and W apart, and a profile of
it measures both (:func:`~mpstream.observe.fitting.fit`).

A batch the split size does not divide ends in a shorter micro-batch:
``last_size`` (:func:`micro_batches` gives it) scales the last
micro-batch's compute and copy times by its size relative to a full one,
so its tasks cost their share of a slot, not a whole one.

Host issue time is modelled when given (``issue_times``): one host thread
issues every task in issue order, taking the task's issue time; a task's
device work cannot start before its issue begins nor end before its issue
ends. A backward's issue time splits as its cost does: a split backward's
passes take the (kind, stage) times of ``'backward'`` (the input pass) and
``'weight'``, a whole backward both; without a ``'weight'`` time, half the
backward's each. On a fast GPU that thread, not the streams, can set the step time.
:func:`~mpstream.observe.fitting.fit` turns a measured timeline into
costs (issue times included where the timeline has them);
:func:`~mpstream.observe.scaling.predict` scales per-layer costs to ``p``
devices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .._words import count_of
from ..schedules import (
    Kind,
    Order,
    Schedule,
    Task,
    Topology,
    default_ranks,
    virtual_stages_for,
)
from ..stages import check_flag
from .cost_args import (
    Cost,
    IssueTimes,
    backward_passes,
    check_hops,
    check_listed,
    check_sizes,
    copy_costs,
    cost_pair,
    device_label,
    issue_costs,
)
from .sharing import replay, sharing_of
from .summary import Summary
from .timeline import Span, Timeline

if TYPE_CHECKING:  # the cost model needs torch only to read a torch.device
    import torch

__all__ = ["Cost", "Simulation", "simulate", "micro_batches"]


@dataclass
class Simulation:
    """A simulated step."""

    step_ms: float
    timeline: Timeline
    schedule: str
    overlap: bool
    issue_ms: float = 0.0  # host time to issue the step (0: not modelled)

    def summary(self, *, echo: bool = True) -> Summary:
        """The simulated timeline's summary: see :meth:`Timeline.summary`."""
        return self.timeline.summary(echo=echo)

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        """Draws the simulated timeline: see :meth:`Timeline.plot`."""
        return self.timeline.plot(path, title=title)


def _tutorial_order(tasks: list[Task]) -> list[Task]:
    # The tutorial's loop runs stage 1's compute of the previous micro-batch
    # before stage 0's compute (and copy) of the next: later stages first
    # within a clock cycle. A copy belongs to its producer's cycle.
    forward = [t for t in tasks if t.kind in (Kind.FORWARD, Kind.COPY)]
    rest = [t for t in tasks if t.kind not in (Kind.FORWARD, Kind.COPY)]

    def key(t: Task) -> tuple[int, int, int]:
        stage = max(t.stage, 0)
        # The batch's copy into stage 0 (from off its device) comes before
        # the forward that reads it, not after as the copies out of a stage.
        after = -1 if t.stage < 0 and t.peer == 0 else 1 if t.kind is Kind.COPY else 0
        return (stage + t.micro, -stage, after)

    return sorted(forward, key=key) + rest


def simulate(
    stage_times: Sequence[Cost],
    copy_times: Cost | Sequence[Cost] | Mapping[tuple[int, int], Cost] = 0.0,
    chunks: int = 1,
    schedule: Order = "gpipe",
    overlap: bool = True,
    *,
    backward: bool | None = None,
    devices: Sequence[str] | None = None,
    reads: Sequence[Sequence[int]] | None = None,
    virtual_stages: int | None = None,
    share_compute: bool | float | None = None,
    issue_times: IssueTimes | None = None,
    force_copies: bool = False,
    last_size: float = 1.0,
    input_device: str | torch.device | None = None,
) -> Simulation:
    """Predicts a pipelined step.

    Args:
        stage_times: per stage, the forward time of one micro-batch, a
            (forward, backward) pair, a (forward, input_grad, weight_grad)
            triple (the passes of a split backward; a backward the schedule
            does not split costs their sum), or a (forward, input_grad,
            weight_grad, backward) quadruple, a whole backward costing the
            last (as ``simulate_fit(profile).per_stage()`` gives them from a
            profile that split some backwards and not others).
        copy_times: per boundary (or one for all), the copy time of one
            micro-batch's activations (its gradient's copy takes as long), or
            a (forward, gradient) pair. For a stage graph (``reads``): one
            for all, one per producing stage, or a mapping from (producer,
            receiving stage) to the time of that copy ((-1, stage): the
            batch's copy into that stage, off its device by
            ``input_device``).
        chunks: number of micro-batches.
        schedule: a built-in schedule (``mpstream.SCHEDULES``) or an
            explicit order of actions (all but ``'gpipe'`` need backward
            times).
        overlap: mpstream's streams (True) or the default streams (False).
        backward: include backward tasks; default: whether any stage has a
            backward time.
        devices: device label of each stage; stages sharing a device share
            its stream when ``overlap`` is False, and need no copy between
            them. Default: one device per stage; for a round-robin schedule
            the stages round-robin over ``stages / virtual_stages`` devices,
            for a V schedule stages ``s`` and ``stages - 1 - s`` on device
            ``s``. A round-robin schedule needs ``devices`` or
            ``virtual_stages``.
        reads: the stage graph, per stage the stages it reads (-1: the
            input); default a chain. A value goes to each device reading it
            in one copy, as mpstream's schedules move it.
        virtual_stages: stages per rank of a schedule of several stages per
            rank (default: from the devices, as the schedule places them).
        share_compute: how stages on one device share its compute. True:
            one at a time, in issue order (a busy device has nothing left
            for a second stage). False: each stage's stream computes as if
            alone. A number in (0, 1]: at once on their streams, each
            filling that share of the device (1.0: two at once each take
            twice as long; 0.5: two fit side by side), so the device runs
            whatever any of its streams has ready. Default: True when two
            stages share a device (their devices as given, or as the
            schedule places them), False when each has its own.
        issue_times: host time (ms) the one issuing thread spends on each
            task: one number for every task, or per (kind, stage) as
            :attr:`Costs.issue_times` holds them (missing: 0; a backward's
            split as its cost, see above). None: issuing
            is free, as on a device much slower than its host. One thread
            is right for ``train_step`` and for any run on one GPU; a
            backward that autograd runs (``pipe(x)`` then ``backward()``)
            over several GPUs is issued by one autograd thread per device,
            in parallel, which this overestimates.
        force_copies: copy between stages on one device too, as
            ``Pipe(force_copies=True)`` does. As ``train_step`` issues it,
            such a copy runs on the sending stage's copy stream only, and
            the receiving stage's copy stream is ordered after it.
        last_size: the last micro-batch's size relative to a full one, in
            (0, 1] (a batch of 10 in micro-batches of 4: 0.5; see
            :func:`micro_batches`). Its compute and copy times are the
            given ones scaled by it; its host issue times are not (a
            shorter micro-batch launches as many kernels).
        input_device: where the batch sits, as ``pipe.schedule_for``'s
            ``input_device``: a label of ``devices`` (or of the default
            ones, ``'device0'``, ...), or any other label (``'cpu'``) for a
            device no stage is on; default the first stage's. A stage
            reading the batch off its device gets a copy of each
            micro-batch before its forward, costing what ``copy_times``
            gives a copy (a per-boundary list: nothing; a mapping: its
            ``(-1, stage)`` entry).

    Returns:
        The predicted step time and its timeline.

    Raises:
        ValueError: inconsistent lengths, ``stage_times`` a mapping, negative
            costs, a schedule with backward tasks without backward times, a round-robin schedule
            with neither ``devices`` nor ``virtual_stages``, ``last_size`` outside (0, 1], or
            an empty ``input_device``.
        TypeError: ``overlap`` or ``backward`` is not a bool, or ``input_device`` is not a
            label (a string or a ``torch.device``).
    """
    check_listed(stage_times, "stage_times")
    overlap = check_flag("overlap", overlap)  # a string such as "no" would read as true
    backward = None if backward is None else check_flag("backward", backward)
    stages = [cost_pair(c, f"stage {i} time") for i, c in enumerate(stage_times)]
    n = len(stages)
    if n < 1:
        raise ValueError("simulate needs at least one stage time")
    graph = tuple(tuple(r) for r in reads) if reads is not None else None
    if graph is not None and len(graph) != n:
        raise ValueError(
            f"reads needs {count_of(n, 'entry', 'entries')} (one per stage), got {len(graph)}"
        )
    copy_cost = copy_costs(copy_times, n, graph is None)
    if devices is None:
        ranks, virtual_stages = default_ranks(schedule, n, virtual_stages)
        devs = [f"device{r}" for r in ranks]
    else:
        devs = list(devices)
    if len(devs) != n:
        raise ValueError(f"devices needs {n} entries, got {len(devs)}")
    source = devs[0] if input_device is None else device_label(input_device)
    if isinstance(copy_times, Mapping):
        check_hops(copy_times, graph, devs, source, bool(force_copies))
    chunks = check_sizes(chunks, last_size)
    with_backward = any(b > 0 for _, b in stages) if backward is None else backward
    labels = list(dict.fromkeys(devs))
    topology = Topology(
        graph if graph is not None else tuple((s - 1,) for s in range(n)),
        tuple(labels.index(d) for d in devs),
        labels.index(source) if source in labels else -1,
        bool(force_copies),
    )
    virtual = virtual_stages_for(schedule, devs, virtual_stages)
    sched = Schedule(schedule, n, chunks, topology, backward=with_backward, virtual_stages=virtual)
    if sched.backward and not with_backward:
        what = "your order" if sched.name == "custom" else sched.name
        if any(b > 0 for _, b in stages):  # predict passes backward=False for none
            raise ValueError(
                f"{what} schedules backwards, but backward=False: drop it, or give 'gpipe' "
                f"to simulate forwards alone"
            )
        raise ValueError(
            f"{what} schedules backwards, but every backward time is 0: give (forward, "
            f"backward) or (forward, input_grad, weight_grad) stage times with a backward cost"
        )
    # Default streams issue fill-drain as the tutorial's loop does; another
    # schedule keeps its order, each device running its tasks in turn.
    tutorial = not overlap and sched.name == "gpipe"
    tasks = _tutorial_order(sched.tasks) if tutorial else sched.tasks
    shared = sharing_of(devs, share_compute)
    splits = [backward_passes(c) for c in stage_times]
    compute = (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)

    def streams(t: Task) -> tuple[str, ...]:
        """The streams a task occupies; the first is a compute task's timeline
        row (a copy's is its receiving stream, as a profile records it)."""
        if t.kind in compute:
            if not overlap:
                return (devs[t.stage],)
            row = f"stage{t.stage}.compute"
            return (row, f"{devs[t.stage]}.compute") if shared is True else (row,)
        src, dst = (t.stage, t.peer) if t.kind is Kind.COPY else (t.peer, t.stage)
        if src < 0:
            # The input lands on the io stream of the receiving stage's
            # device, which is all the runtime makes current; on default
            # streams it blocks the batch's device too, where a stage is.
            if overlap:
                return (f"io@{devs[dst]}",)
            return (source, devs[dst]) if source in devs else (devs[dst],)
        if overlap:
            if forced(t):
                return (f"stage{src}.copy",)
            return (f"stage{src}.copy", f"stage{dst}.copy")
        return (devs[src], devs[dst])

    def forced(t: Task) -> bool:
        """A copy between two stages on one device. The runtime issues it
        on the sender's copy stream: only one stream of a device is current
        (a copy across devices orders both ends itself)."""
        return (
            t.kind in (Kind.COPY, Kind.COPY_GRAD) and t.stage >= 0 and devs[t.stage] == devs[t.peer]
        )

    def after(t: Task) -> tuple[str, ...]:
        """Streams ordered after a task without running it: a forced copy's
        receiving copy stream, which waits for the copy and records the
        event its readers wait for."""
        if not (overlap and forced(t)):
            return ()
        return (f"stage{t.peer if t.kind is Kind.COPY else t.stage}.copy",)

    def full(t: Task) -> float:
        """A task's time for a full micro-batch."""
        if t.kind is Kind.FORWARD:
            return stages[t.stage][0]
        if t.kind is Kind.BACKWARD:
            split = (t.stage, t.micro) in sched.split
            return splits[t.stage][0] if split else stages[t.stage][1]
        if t.kind is Kind.WEIGHT:
            return splits[t.stage][1]
        forward, gradient = copy_cost(t.stage, t.peer)
        return float(forward if t.kind is Kind.COPY else gradient)

    last = chunks - 1

    def cost(t: Task) -> float:
        # Compute and copies grow with the rows (what fitting assumes too).
        return full(t) * last_size if t.micro == last else full(t)

    issue = issue_costs(issue_times, sched.split)
    timing = replay(tasks, streams, cost, issue, devs, shared if overlap else False, after)
    spans = []
    for t, (start, stop, issuing) in zip(tasks, timing):
        on = streams(t) + after(t)
        if t.kind in compute and overlap:
            on = on[:1]
        spans.append(
            Span(
                t.stage,
                t.micro,
                t.kind.label,
                on[-1] if t.kind in (Kind.COPY, Kind.COPY_GRAD) else on[0],
                start,
                stop,
                peer=t.peer if t.kind in (Kind.COPY, Kind.COPY_GRAD) else -1,
                issue_ms=issuing,
            )
        )
    host = sum(issuing for _, _, issuing in timing)
    if overlap:
        rows = {f"stage{s}.{r}": devs[s] for s in range(n) for r in ("compute", "copy")}
        rows |= {f"io@{devs[t.peer]}": devs[t.peer] for t in sched.tasks if t.stage < 0}
    else:
        rows = {d: d for d in dict.fromkeys(devs)}
    hop_pairs = sorted({(t.stage, t.peer) for t in sched.tasks if t.kind is Kind.COPY})
    meta = {
        "stage_times": stages,
        "copy_times": [copy_cost(p, q) for p, q in hop_pairs],
        "copies": [f"{p}->{q}" for p, q in hop_pairs],
        "chunks": chunks,
        "schedule": sched.name,
        "overlap": overlap,
        "virtual_stages": virtual,
        "share_compute": shared,
        "issue_ms": host,
        "last_size": float(last_size),
    }
    timeline = Timeline(spans, rows, "simulated", meta)
    step = max((stop for _, stop, _ in timing), default=0.0)
    return Simulation(step, timeline, sched.name, overlap, host)


def micro_batches(batch_size: int, split_size: int) -> tuple[int, float]:
    """How many micro-batches a batch splits into, and the last one's size
    relative to a full one (``simulate``'s ``chunks`` and ``last_size``).

    Args:
        batch_size: rows in the batch.
        split_size: rows in a full micro-batch.

    Returns:
        ``(ceil(batch_size / split_size), rows of the last / split_size)``:
        ``(3, 0.5)`` for 10 rows in micro-batches of 4.

    Raises:
        ValueError: either is not a positive int.
    """
    for name, value in (("batch_size", batch_size), ("split_size", split_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"micro_batches: {name} must be a positive int, got {value!r}")
    count = math.ceil(batch_size / split_size)
    return count, (batch_size - (count - 1) * split_size) / split_size

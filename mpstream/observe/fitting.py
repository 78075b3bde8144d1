"""Costs from a measured timeline, for the cost model.

:func:`fit` takes the median per-micro-batch time of each task kind per
stage and per copy (and, where the scheduler measured it, the host's time to
issue each task) from a profile; :class:`Costs` holds them in the form
:func:`~mpstream.observe.cost_model.simulate` takes. A profile whose last
micro-batch was shorter (``last_size``) has its compute and copies scaled up
to a full one's first: a median over one full and one short micro-batch is
neither, and ``simulate(last_size=)`` scales the last one down again.
"""

from __future__ import annotations

import numbers
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .cost_model import Cost
from .timeline import Span, Timeline

__all__ = ["Costs", "fit", "issue_spread"]


@dataclass
class Costs:
    """Per micro-batch costs in milliseconds.

    Attributes:
        stage_times: per stage, (forward, backward); the backward is the
            input-gradient pass where the profile split it.
        copy_times: per boundary s -> s + 1, (forward copy, gradient copy).
        hops: per copy of a stage graph, (producer, receiving stage) ->
            (forward copy, gradient copy); skips included.
        weight_times: per stage, the weight-gradient pass, where the profile
            had split backwards (empty otherwise).
        issue_times: host time to issue one task, per (kind, stage), where
            the timeline measured it (empty otherwise).
        whole_times: per stage, a whole (unsplit) backward, where the
            profile split some backwards and ran others whole
            (``'dualpipev'``; empty otherwise): one autograd pass, which
            costs less than the input and weight passes apart. A stage
            whose backwards were all split gets their sum.
    """

    stage_times: list[tuple[float, float]]
    copy_times: list[tuple[float, float]]
    hops: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    weight_times: list[float] = field(default_factory=list)
    issue_times: dict[tuple[str, int], float] = field(default_factory=dict)
    whole_times: list[float] = field(default_factory=list)

    def per_stage(self) -> list[Cost]:
        """Stage costs for :func:`~mpstream.observe.cost_model.simulate`: (forward, backward);
        (forward, input_grad, weight_grad) when the profile split backwards; (forward,
        input_grad, weight_grad, backward) when it split some and ran others whole."""
        if not self.weight_times:
            return list(self.stage_times)
        if self.whole_times:
            return [
                (f, b, w, whole)
                for (f, b), w, whole in zip(self.stage_times, self.weight_times, self.whole_times)
            ]
        return [(f, b, w) for (f, b), w in zip(self.stage_times, self.weight_times)]


def fit(timeline: Timeline, last_size: float = 1.0) -> Costs:
    """Median per-micro-batch costs of each stage and boundary in a measured timeline.

    From a run with split backwards (``'zb_h1'``) the costs hold both passes:
    ``costs.per_stage()`` gives (forward, input_grad, weight_grad) triples.
    Where a run split only some backwards (``'dualpipev'``), the input pass
    is fitted from the split ones alone, and the whole ones' median is kept
    apart (``costs.whole_times``; ``per_stage()`` gives (forward,
    input_grad, weight_grad, backward) quadruples): one autograd pass costs
    less than its two split passes, by more than half at tasks of a few
    tenths of a millisecond on a CPU.
    Where the spans carry the host's issue time (``Span.issue_ms``, measured
    by the scheduler's timing), ``costs.issue_times`` holds its median per
    (kind, stage) (a backward's, where the run split some, the input
    pass's, as for its cost, and a whole one's under ``'whole_backward'``),
    for :func:`~mpstream.observe.cost_model.simulate`'s ``issue_times``.

    Args:
        timeline: the measured timeline.
        last_size: the last micro-batch's size relative to a full one, in
            (0, 1], as ``simulate`` takes it
            (:func:`~mpstream.observe.cost_model.micro_batches` gives it):
            its compute and copy times count as ``1 / last_size`` times
            what they took (its issue times as they were).

    Returns:
        Per micro-batch costs of a full micro-batch.

    Raises:
        TypeError: ``timeline`` is not a :class:`Timeline`.
        ValueError: the timeline has no compute spans, or ``last_size``
            is outside (0, 1].
        RuntimeError: a profile read inside its ``with`` block.
    """
    if not isinstance(timeline, Timeline):
        # A path or the dict of an exported Chrome trace is not read back:
        # the trace keeps neither a copy's receiving stage nor issue times.
        raise TypeError(
            f"simulate_fit takes a Timeline (the profile of a `with mpstream.profile(pipe) "
            f"as prof:` block, a simulation's .timeline, or a Timeline(spans, "
            f"stream_devices) of your own), got {type(timeline).__name__}; an exported "
            f"Chrome trace (trace.json) is not read back: fit the profile itself"
        )
    if isinstance(last_size, bool) or not (
        isinstance(last_size, numbers.Real) and 0 < last_size <= 1
    ):
        raise ValueError(f"last_size must be in (0, 1], got {last_size!r}")
    timeline.check_readable()
    last = max((s.micro for s in timeline.spans), default=0)

    def duration(s: Span) -> float:
        return s.duration_ms / last_size if s.micro == last else s.duration_ms

    groups: dict[tuple[str, int], list[Span]] = defaultdict(list)
    hops: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    # A backward with a weight pass of its own computed the input gradient
    # only; schedules such as dualpipev split some micro-batches and not
    # others, and one median of both would be neither.
    spans = _per_hop(timeline.spans)
    split = {(s.stage, s.micro, s.run) for s in spans if s.kind == "weight"}
    for s in spans:
        whole = s.kind == "backward" and split and (s.stage, s.micro, s.run) not in split
        groups[("whole_backward" if whole else s.kind, s.stage)].append(s)
        if s.kind in ("copy", "copy_grad") and s.stage >= 0:
            hops[(s.kind, s.stage, s.stages[0] if s.kind == "copy_grad" else s.stages[-1])].append(
                duration(s)
            )
    stages = timeline.stages
    if not any(k in ("forward", "backward") for k, _ in groups):
        raise ValueError("the timeline has no compute spans to fit")

    def median(kind: str, stage: int, issue: bool = False) -> float:
        spans = groups.get((kind, stage))
        if not spans:
            return 0.0
        return float(statistics.median(s.issue_ms if issue else duration(s) for s in spans))

    def hop(kind: str, p: int, q: int) -> float:
        values = hops.get((kind, p, q))
        return statistics.median(values) if values else 0.0

    def backward(stage: int, issue: bool = False) -> float:
        if ("backward", stage) in groups or ("whole_backward", stage) not in groups:
            return median("backward", stage, issue)
        # This stage's backwards were all whole: the input pass is the rest.
        whole = median("whole_backward", stage, issue)
        return max(whole - median("weight", stage, issue), 0.0)

    pairs = {(p, q) for _, p, q in hops}
    weighted = bool(split)
    # A stage without whole backwards (all split) runs a whole one as both passes.
    mixed = weighted and any(kind == "whole_backward" for kind, _ in groups)
    wholes = (
        [
            median("whole_backward", s)
            if ("whole_backward", s) in groups
            else backward(s) + median("weight", s)
            for s in range(stages)
        ]
        if mixed
        else []
    )
    # The issue times' medians as the costs' (a whole backward issues both passes).
    issue = {k: med for k, (_, _, med, _) in issue_spread(timeline).items()}
    if issue and weighted:
        issue.update(
            {
                ("backward", s): backward(s, issue=True)
                for s in range(stages)
                if ("backward", s) in groups or ("whole_backward", s) in groups
            }
        )
        # A whole backward is one autograd call to issue, not the two passes'.
        issue.update(
            {
                ("whole_backward", s): median("whole_backward", s, issue=True)
                for s in range(stages)
                if ("whole_backward", s) in groups
            }
        )
    return Costs(
        [(median("forward", s), backward(s)) for s in range(stages)],
        [(median("copy", s), median("copy_grad", s)) for s in range(stages - 1)],
        {(p, q): (hop("copy", p, q), hop("copy_grad", p, q)) for p, q in sorted(pairs)},
        [median("weight", s) for s in range(stages)] if weighted else [],
        issue,
        wholes,
    )


def issue_spread(timeline: Timeline) -> dict[tuple[str, int], tuple[int, float, float, float]]:
    """The host's issue times per (kind, stage): count, min, median and max (ms).

    :func:`fit` keeps the median. Where the device sets the pace, a launch
    also waits while the device's queue is full, so the median can hold
    waiting; the minimum is the launch that did not wait. Empty where the
    timeline has no issue times.
    """
    issue: dict[tuple[str, int], list[float]] = defaultdict(list)
    for s in _per_hop(timeline.spans):
        issue[(s.kind, s.stage)].append(s.issue_ms)
    # Timelines from before issue times were measured hold zeros: no issue times.
    if not any(v > 0 for values in issue.values() for v in values):
        return {}
    return {k: (len(v), min(v), statistics.median(v), max(v)) for k, v in sorted(issue.items())}


def _per_hop(spans: Sequence[Span]) -> list[Span]:
    """``spans`` with the gradient copies of one hop, micro-batch and run
    taken as one per backward pass: from the first one's start, each as
    long as they took together (and issued in the time they took together)
    over the passes.

    In the user's own loop each tensor of a hop sends its gradient in a
    copy of its own (:class:`~mpstream.runtime.copy.Copy`), where the cost
    model, like a training step, has one per hop. A forward may also be
    backed through more than once (``retain_graph=True``): all its passes
    count in its run, so the copies are split over the passes, which the
    receiving stage's backward spans count (a pass that sent the hop's
    gradient reached that stage).
    """
    passes: Counter[tuple[int, int, int]] = Counter(
        (s.stage, s.micro, s.run) for s in spans if s.kind == "backward"
    )
    out: list[Span] = []
    grads: dict[tuple[int, int, int, int], list[Span]] = defaultdict(list)
    for s in spans:
        if s.kind == "copy_grad":
            grads[(s.stage, s.peer, s.micro, s.run)].append(s)
        else:
            out.append(s)
    for (stage, _, micro, run), group in grads.items():
        # At least one copy per pass; a timeline without backward spans
        # (a synthetic one) has one pass.
        n = min(max(passes[(stage, micro, run)], 1), len(group))
        start = min(s.start_ms for s in group)
        length = sum(s.duration_ms for s in group) / n
        issue = sum(s.issue_ms for s in group) / n
        out += [replace(group[0], start_ms=start, end_ms=start + length, issue_ms=issue)] * n
    return out

"""The host's issue time in the cost model: one thread issuing every task
(mpstream.observe.cost_model), issue times fitted from measured spans
(fitting) and summed per stage from per-layer ones (scaling), a split
backward's passes as its costs split."""

from __future__ import annotations

import pytest

from mpstream.observe.cost_model import simulate
from mpstream.observe.fitting import fit, issue_spread
from mpstream.observe.scaling import predict
from mpstream.observe.timeline import Span, Timeline


def test_a_host_bound_step_takes_the_hosts_issue_time() -> None:
    issue = {("forward", 0): 3.0, ("forward", 1): 3.0}
    free = simulate([1.0, 1.0], 0.0, 4)
    assert free.step_ms == pytest.approx(5.0) and free.issue_ms == 0.0
    # One thread issues all 8 forwards, 3 ms each: the devices wait on it.
    bound = simulate([1.0, 1.0], 0.0, 4, issue_times=issue)
    assert bound.step_ms == pytest.approx(24.0)
    assert bound.issue_ms == pytest.approx(24.0)
    assert bound.timeline.meta["issue_ms"] == pytest.approx(24.0)
    # Cheap issue: the devices set the pace, the host adds its first task's lead.
    cheap = simulate([1.0, 1.0], 0.0, 4, issue_times=0.1)
    assert free.step_ms <= cheap.step_ms <= free.step_ms + 0.1 * 12
    # The tutorial's default streams are host-bound the same way.
    assert simulate([1.0, 1.0], 0.0, 4, overlap=False, issue_times=issue).step_ms == pytest.approx(
        24.0
    )


def test_issue_times_are_checked() -> None:
    bad = "issue_times must be finite and not negative"
    with pytest.raises(ValueError, match=bad):
        simulate([1.0], 0.0, 2, issue_times=-1.0)
    with pytest.raises(ValueError, match=bad):
        simulate([1.0], 0.0, 2, issue_times=float("inf"))
    with pytest.raises(ValueError, match=bad):
        simulate([1.0], 0.0, 2, issue_times={("forward", 0): -1.0})
    for nan in ((float("nan"), 2.0), (1.0, 1.0, float("nan"))):
        with pytest.raises(ValueError, match="must be finite and not negative"):
            simulate([nan, (1.0, 2.0)], 0.0, 2)
    with pytest.raises(ValueError, match="must be finite and not negative"):
        simulate([(1.0, 2.0)] * 2, float("nan"), 2)
    with pytest.raises(ValueError, match=r"issue_times needs 2 entries \(one per layer\), got 1"):
        predict([1.0, 1.0], 2, 4, issue_times=[1.0])


def test_fit_takes_issue_times_from_spans_that_carry_them() -> None:
    spans = [
        Span(s, m, kind, f"stage{s}.compute", 0.0, 1.0, issue_ms=0.5 + s)
        for s in range(2)
        for m in range(3)
        for kind in ("forward", "backward")
    ]
    costs = fit(Timeline(spans, {"stage0.compute": "d0", "stage1.compute": "d1"}))
    assert costs.issue_times == {
        ("forward", 0): 0.5,
        ("backward", 0): 0.5,
        ("forward", 1): 1.5,
        ("backward", 1): 1.5,
    }
    legacy = [Span(s.stage, s.micro, s.kind, s.stream, 0.0, 1.0) for s in spans]
    assert fit(Timeline(legacy, {"stage0.compute": "d0", "stage1.compute": "d1"})).issue_times == {}


def test_issue_spread_shows_launches_that_waited_beside_those_that_did_not() -> None:
    # A device-bound run: the first launches return at once, later ones wait
    # for room in the device's queue.
    spans = [
        Span(0, m, "forward", "stage0.compute", 0.0, 1.0, issue_ms=w)
        for m, w in enumerate([0.2, 0.3, 4.0, 5.0, 6.0])
    ]
    timeline = Timeline(spans, {"stage0.compute": "d0"})
    assert issue_spread(timeline) == {("forward", 0): (5, 0.2, 4.0, 6.0)}
    assert fit(timeline).issue_times == {("forward", 0): 4.0}  # the median holds the waits
    legacy = Timeline([Span(0, 0, "forward", "stage0.compute", 0.0, 1.0)], {"stage0.compute": "d0"})
    assert issue_spread(legacy) == {}


def test_a_host_bound_pipeline_loses_to_the_whole_batch_on_one_device() -> None:
    layers = [(1.0, 2.0)] * 4
    device_bound = predict(layers, 2, 4)
    assert device_bound.speedup > 1.5
    # Issuing a layer costs the host more than running it: one host thread
    # issues all 16 tasks of the pipeline (10 ms each), while the single
    # device runs the whole batch (4 x 12 ms of work) issuing each kernel once.
    host_bound = predict(layers, 2, 4, issue_times=[(5.0, 5.0)] * 4)
    assert host_bound.step_ms == pytest.approx(160.0)
    # forward: issued by 20 ms, runs 16; backward: issued 20..40, runs 32 from 20.
    assert host_bound.single_device_ms == pytest.approx(52.0)
    assert host_bound.speedup == pytest.approx(52.0 / 160.0)


def _issued(sim: object, kind: str) -> list[float]:
    return [s.issue_ms for s in sim.timeline.spans if s.kind == kind]  # type: ignore[attr-defined]


def test_a_split_backward_issues_its_passes_as_its_costs_split() -> None:
    # Without a weight pass's time, each pass takes half the backward's, as
    # a (forward, backward) cost splits; a whole backward issues both.
    issue = {("forward", 0): 1.0, ("backward", 0): 4.0, ("forward", 1): 1.0, ("backward", 1): 4.0}
    zb = simulate([(1.0, 2.0)] * 2, 0.0, 4, "zb_h1", issue_times=issue)
    assert _issued(zb, "weight") == [2.0] * 8 and _issued(zb, "backward") == [2.0] * 8
    plain = simulate([(1.0, 2.0)] * 2, 0.0, 4, "1f1b", issue_times=issue)
    assert _issued(plain, "backward") == [4.0] * 8
    assert zb.issue_ms == pytest.approx(plain.issue_ms)
    # With one, each pass takes its own, and a whole backward both.
    issue[("weight", 0)] = issue[("weight", 1)] = 3.0
    zb = simulate([(1.0, 2.0)] * 2, 0.0, 4, "zb_h1", issue_times=issue)
    assert _issued(zb, "weight") == [3.0] * 8 and _issued(zb, "backward") == [4.0] * 8
    plain = simulate([(1.0, 2.0)] * 2, 0.0, 4, "1f1b", issue_times=issue)
    assert _issued(plain, "backward") == [7.0] * 8
    # One number is every task's, a weight pass's too.
    each = simulate([(1.0, 2.0)] * 2, 0.0, 4, "zb_h1", issue_times=0.5)
    assert set(_issued(each, "weight")) == {0.5} and set(_issued(each, "backward")) == {0.5}


def test_fit_takes_the_input_pass_issue_time_where_a_run_split_some_backwards() -> None:
    # Stage 0 splits micro-batch 0 (B issued in 1 ms, W in 2) and not 1 (a
    # whole backward, 3 ms), as dualpipev does; stage 1 splits none.
    streams = {"stage0.compute": "d0", "stage1.compute": "d1"}
    spans = [
        Span(0, 0, "backward", "stage0.compute", 0.0, 1.0, issue_ms=1.0),
        Span(0, 0, "weight", "stage0.compute", 1.0, 2.0, issue_ms=2.0),
        Span(0, 1, "backward", "stage0.compute", 2.0, 4.0, issue_ms=3.0),
        Span(1, 0, "backward", "stage1.compute", 0.0, 1.0, issue_ms=5.0),
        Span(1, 0, "forward", "stage1.compute", 0.0, 1.0, issue_ms=0.5),
    ]
    issue = fit(Timeline(spans, streams)).issue_times
    assert issue[("backward", 0)] == 1.0 and issue[("weight", 0)] == 2.0
    assert issue[("backward", 1)] == 5.0  # whole, and no weight pass: as measured


def test_a_whole_backward_issues_in_the_time_a_whole_one_took() -> None:
    # As its cost: one autograd call to issue, not the split passes' two
    # (1 + 2 ms here against 1.5 ms measured).
    streams = {"stage0.compute": "d0", "stage1.compute": "d1"}
    spans = [
        Span(0, 0, "backward", "stage0.compute", 0.0, 1.0, issue_ms=1.0),
        Span(0, 0, "weight", "stage0.compute", 1.0, 2.0, issue_ms=2.0),
        Span(0, 1, "backward", "stage0.compute", 2.0, 4.0, issue_ms=1.5),
        Span(1, 0, "forward", "stage1.compute", 0.0, 1.0, issue_ms=0.5),
    ]
    issue = fit(Timeline(spans, streams)).issue_times
    assert issue[("backward", 0)] == 1.0 and issue[("whole_backward", 0)] == 1.5
    issue = {("backward", 0): 1.0, ("weight", 0): 2.0, ("whole_backward", 0): 1.5}
    sim = simulate([(1.0, 1.0, 2.0)] * 4, 0.0, 8, "dualpipev", issue_times=issue)
    split = {(s.stage, s.micro) for s in sim.timeline.spans if s.kind == "weight"}
    backwards = [s for s in sim.timeline.spans if s.kind == "backward" and s.stage == 0]
    assert {s.issue_ms for s in backwards if (s.stage, s.micro) in split} == {1.0}
    assert {s.issue_ms for s in backwards if (s.stage, s.micro) not in split} == {1.5}
    # Without it, a whole backward issues both passes.
    del issue[("whole_backward", 0)]
    sim = simulate([(1.0, 1.0, 2.0)] * 4, 0.0, 8, "dualpipev", issue_times=issue)
    whole = [s for s in sim.timeline.spans if s.kind == "backward" and (s.stage, s.micro) == (0, 0)]
    assert [s.issue_ms for s in whole] == [3.0]


def test_predict_sums_each_passs_issue_time_over_a_stages_layers() -> None:
    layers = [(1.0, 1.0, 1.0)] * 4
    triples = predict(layers, 2, 4, schedule="zb_h1", issue_times=[(0.1, 0.2, 0.3)] * 4)
    assert _issued(triples.simulation, "backward") == [pytest.approx(0.4)] * 8
    assert _issued(triples.simulation, "weight") == [pytest.approx(0.6)] * 8
    pairs = predict(layers, 2, 4, schedule="zb_h1", issue_times=[(0.1, 0.5)] * 4)
    assert _issued(pairs.simulation, "weight") == [pytest.approx(0.5)] * 8
    assert pairs.simulation.issue_ms == pytest.approx(triples.simulation.issue_ms)
    # A quadruple's whole backward issues in its own time (1f1b), its passes in theirs (zb_h1).
    quads = [(0.1, 0.2, 0.3, 0.35)] * 4
    plain = predict(layers, 2, 4, schedule="1f1b", issue_times=quads)
    assert _issued(plain.simulation, "backward") == [pytest.approx(0.7)] * 8
    split = predict(layers, 2, 4, schedule="zb_h1", issue_times=quads)
    assert _issued(split.simulation, "weight") == [pytest.approx(0.6)] * 8

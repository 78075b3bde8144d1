"""Fitting the cost model to a timeline: medians per stage and boundary, split
backwards (forward, input grad, weight grad) fitted from the spans that split
them, and a fit simulated again reproduces the timeline."""

from __future__ import annotations

import statistics

import pytest
import torch
from torch import nn

from mpstream import Pipe, profile
from mpstream.observe.cost_model import simulate
from mpstream.observe.fitting import fit
from mpstream.observe.timeline import Span, Timeline


def test_fit_takes_medians_per_stage_and_boundary() -> None:
    spans = [
        Span(0, 0, "forward", "a", 0, 2),
        Span(0, 1, "forward", "a", 2, 4),
        Span(0, 2, "forward", "a", 4, 9),
        Span(1, 0, "forward", "b", 3, 6),
        Span(1, 0, "backward", "b", 6, 12),
        Span(0, 0, "backward", "a", 12, 16),
        Span(0, 0, "copy", "c", 2, 3),
        Span(0, 0, "copy_grad", "c", 12, 12.5),
    ]
    costs = fit(Timeline(spans, {"a": "d0", "b": "d1", "c": "d1"}))
    assert costs.stage_times == [(2.0, 4.0), (3.0, 6.0)]
    assert costs.copy_times == [(1.0, 0.5)]
    with pytest.raises(ValueError, match="no compute spans"):
        fit(Timeline([Span(0, 0, "copy", "c", 0, 1)], {"c": "d"}))
    with pytest.raises(TypeError, match="simulate_fit takes a Timeline .* got list") as info:
        fit([])  # type: ignore[arg-type]
    # It named a Timeline.load() that does not exist.
    assert "load" not in str(info.value) and not hasattr(Timeline, "load")
    with pytest.raises(TypeError, match=r"got str; an exported Chrome trace .* is not read back"):
        fit("trace.json")  # type: ignore[arg-type]


def test_fit_then_simulate_reproduces_a_constant_cost_timeline() -> None:
    truth = simulate([(1.0, 2.0), (1.0, 2.0), (1.0, 2.0)], (0.25, 0.25), 6)
    costs = fit(truth.timeline)
    again = simulate(costs.stage_times, costs.copy_times, 6)
    assert again.step_ms == pytest.approx(truth.step_ms)


def test_costs_as_triples_and_split_timelines_fit() -> None:
    # A triple is (forward, input grad, weight grad): unsplit schedules add them.
    assert simulate([(1.0, 0.5, 1.5)] * 2, 0.0, 4, "1f1b").step_ms == pytest.approx(
        simulate([(1.0, 2.0)] * 2, 0.0, 4, "1f1b").step_ms
    )
    truth = simulate([(1.0, 0.5, 1.5), (2.0, 1.0, 1.0)], 0.0, 5, "zb_h1")
    kinds = {s.kind for s in truth.timeline.spans}
    assert kinds == {"forward", "backward", "weight", "copy", "copy_grad"}
    costs = fit(truth.timeline)
    assert costs.per_stage() == [(1.0, 0.5, 1.5), (2.0, 1.0, 1.0)]
    assert simulate(costs.per_stage(), 0.0, 5, "zb_h1").step_ms == pytest.approx(truth.step_ms)
    # A pair splits evenly when a schedule needs both passes.
    assert simulate([(1.0, 2.0)] * 2, 0.0, 4, "zb_h1").step_ms == pytest.approx(
        simulate([(1.0, 1.0, 1.0)] * 2, 0.0, 4, "zb_h1").step_ms
    )
    with pytest.raises(ValueError, match="negative"):
        simulate([(1.0, -1.0, 1.0)], 0.0, 1, "zb_h1")


def test_a_triple_as_a_list_or_an_array_row_splits_as_a_tuple_does() -> None:
    # A list or an array's row is taken as a triple (its backward is B + W):
    # a split backward must take its B and W too, not half their sum each.
    import numpy as np

    want = simulate([(1.0, 2.0, 3.0)] * 2, 0.0, 4, "zb_h1")
    rows = [[1.0, 2.0, 3.0]] * 2
    for costs in (rows, np.array(rows), torch.tensor(rows)):
        got = simulate(costs, 0.0, 4, "zb_h1")  # type: ignore[arg-type]
        assert got.step_ms == pytest.approx(want.step_ms)
        assert got.timeline.spans == want.timeline.spans


def test_a_timeline_that_split_some_backwards_fits_the_input_pass_from_those() -> None:
    # dualpipev splits a few backwards per stage; a median over whole and
    # input-only backwards fitted whole ones (57 ms refitted as 78 ms).
    costs = [(1.0, 0.5, 1.5), (2.0, 1.0, 1.0)] * 2
    truth = simulate(costs, 0.0, 8, "dualpipev")
    fitted = fit(truth.timeline)
    # Its whole backwards fitted apart: here they cost B + W, as the triples say.
    assert fitted.per_stage() == [(f, b, w, b + w) for f, b, w in costs]
    assert simulate(fitted.per_stage(), 0.0, 8, "dualpipev").step_ms == truth.step_ms
    # A stage whose backwards were all whole: the input pass is what the weight pass leaves.
    spans = [
        Span(0, 0, "forward", "a", 0, 1),
        Span(0, 0, "backward", "a", 1, 4),
        Span(1, 0, "forward", "b", 1, 2),
        Span(1, 0, "backward", "b", 2, 3),
        Span(1, 0, "weight", "b", 3, 5),
    ]
    assert fit(Timeline(spans, {"a": "d0", "b": "d1"})).per_stage() == [
        (1.0, 3.0, 0.0, 3.0),
        (1.0, 1.0, 2.0, 3.0),  # no whole backward: B + W
    ]


def test_a_fitted_whole_backward_costs_what_it_took_not_its_split_passes() -> None:
    # One autograd pass costs less than B and W apart (on a CPU at tasks of
    # a few tenths of a millisecond, about half): dualpipev's fitted step
    # re-simulated 23% to 85% long when its whole backwards cost B + W.
    costs = [(1.0, 1.5, 1.5, 2.0), (2.0, 1.0, 2.0, 1.5)] * 2
    truth = simulate(costs, 0.0, 8, "dualpipev")
    fitted = fit(truth.timeline)
    assert fitted.per_stage() == costs
    assert fitted.whole_times == [2.0, 1.5] * 2
    assert simulate(fitted.per_stage(), 0.0, 8, "dualpipev").step_ms == truth.step_ms
    # Each whole backward of a real step's simulation costs the median of
    # the measured whole ones; structural, whatever the machine's load.
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    pipe = Pipe(
        model,
        chunks=8,
        balance=[1] * 4,
        devices=["cpu"] * 4,
        schedule="dualpipev",
        virtual_stages=2,
    )
    x, y = torch.randn(32, 32), torch.randn(32, 32)
    pipe.train_step(x, y, nn.MSELoss())  # warm-up: the first step's passes are slower
    with profile(pipe) as prof:
        pipe.train_step(x, y, nn.MSELoss())
    sim = simulate(
        fit(prof).per_stage(), 0.0, 8, "dualpipev", devices=["cpu"] * 4, virtual_stages=2
    )

    def whole(spans: list[Span]) -> dict[int, list[float]]:
        split = {(s.stage, s.micro) for s in spans if s.kind == "weight"}
        out: dict[int, list[float]] = {}
        for s in spans:
            if s.kind == "backward" and (s.stage, s.micro) not in split:
                out.setdefault(s.stage, []).append(s.duration_ms)
        return out

    measured, simulated = whole(prof.spans), whole(sim.timeline.spans)
    assert sorted(measured) == sorted(simulated) == [0, 1, 2, 3]
    for stage, durations in measured.items():
        assert simulated[stage] == [pytest.approx(statistics.median(durations))] * len(durations)

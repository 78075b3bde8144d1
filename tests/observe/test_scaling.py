"""Predicting more devices from per-layer costs: a balance, the step and the
speed-up over one device, split backwards kept per layer, and balances that
cannot fit refused."""

from __future__ import annotations

import pytest

from mpstream.observe.cost_model import simulate
from mpstream.observe.scaling import predict


def test_predict_balances_and_reports_speedup() -> None:
    layers = [(1.0, 2.0)] * 8
    pred = predict(layers, 2, 8)
    assert pred.balance == [4, 4]
    assert pred.single_device_ms == pytest.approx(8 * 8 * 3.0)
    assert pred.step_ms == pytest.approx((8 + 1) * 4 * 3.0)
    assert pred.speedup == pytest.approx(64 * 3.0 / (9 * 12.0))
    four = predict(layers, 4, 8, balance=[2, 2, 2, 2])
    assert four.speedup > pred.speedup


def test_predict_keeps_the_layers_split_backwards() -> None:
    # (F, B_in, W) per layer: a zero-bubble schedule's B and W take the
    # layers' own passes (3 + 3 and 0.5 + 0.5 per stage), not half the
    # stage's backward each.
    layers = [(1.0, 3.0, 0.5)] * 4
    pred = predict(layers, 2, 8, schedule="zb_h1", balance=[2, 2])
    alike = simulate([(2.0, 6.0, 1.0)] * 2, 0.0, 8, "zb_h1")
    assert pred.step_ms == pytest.approx(alike.step_ms)
    weights = [s.duration_ms for s in pred.simulation.timeline.spans if s.kind == "weight"]
    assert weights == [pytest.approx(1.0)] * len(weights) and weights


def test_predict_keeps_the_layers_whole_backwards_apart_from_their_passes() -> None:
    # (F, B_in, W, backward) per layer: a whole backward takes the layers'
    # whole ones (1f1b), split passes theirs (zb_h1).
    layers = [(1.0, 3.0, 0.5, 2.5)] * 4
    plain = predict(layers, 2, 8, schedule="1f1b", balance=[2, 2])
    assert plain.step_ms == pytest.approx(simulate([(2.0, 5.0)] * 2, 0.0, 8, "1f1b").step_ms)
    split = predict(layers, 2, 8, schedule="zb_h1", balance=[2, 2])
    assert split.step_ms == pytest.approx(simulate([(2.0, 6.0, 1.0)] * 2, 0.0, 8, "zb_h1").step_ms)


@pytest.mark.parametrize("balance", [[1, 1], [2, 3], [1, 1, 2], [0, 4]])
def test_predict_refuses_a_balance_that_does_not_fit(balance: list[int]) -> None:
    with pytest.raises(ValueError, match="must give each of the 2 stages at least one layer"):
        predict([(1.0, 1.0)] * 4, 2, 4, balance=balance)


def test_predict_with_nothing_to_run() -> None:
    assert predict([(0.0, 0.0)] * 4, 2, 4).speedup == 1.0

"""A batch the split size does not divide: its last micro-batch is shorter,
and the cost model, the doctor's fit check and the tutorial's validation
cost it as its share of a slot (the step is the sum of its micro-batches'
costs where nothing overlaps), not a whole one."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from mpstream.doctor import costfit
from mpstream.observe.cost_model import micro_batches, simulate
from mpstream.observe.fitting import Costs
from mpstream.tutorial import analysis
from mpstream.tutorial.design import QUICK

STAGES = [(1.0, 2.0), (0.5, 1.5)]  # per full micro-batch, (forward, backward) ms
FULL = sum(f + b for f, b in STAGES)


def test_micro_batches_counts_and_sizes_the_last() -> None:
    assert micro_batches(10, 4) == (3, 0.5)
    assert micro_batches(8, 4) == (2, 1.0)
    assert micro_batches(3, 4) == (1, 0.75)
    for bad in ((0, 4), (8, 0), (8.0, 4), (True, 4)):
        with pytest.raises(ValueError, match="must be a positive int"):
            micro_batches(*bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize("overlap", [True, False])
def test_one_device_steps_the_sum_of_its_micro_batches(schedule: str, overlap: bool) -> None:
    # Both stages on one host, as the tutorial's validation models the CPU:
    # nothing overlaps, so the step is every micro-batch's cost added up.
    micros, last = micro_batches(10, 4)
    sim = simulate(STAGES, 0.0, micros, schedule, overlap, devices=["host", "host"], last_size=last)
    assert sim.step_ms == pytest.approx((micros - 1) * FULL + last * FULL)
    assert sim.timeline.meta["last_size"] == 0.5
    whole = simulate(STAGES, 0.0, micros, schedule, overlap, devices=["host", "host"])
    assert whole.step_ms == pytest.approx(micros * FULL)  # last_size=1.0: as before


def test_the_last_micro_batchs_compute_and_copies_take_their_share() -> None:
    # Two devices, forwards only, a 1 ms copy: by hand, stage 0 computes at
    # 0-2, 2-4, 4-5; the copies run 2-3, 4-5, 5-5.5; stage 1 at 3-5, 5-7, 7-8.
    sim = simulate([2.0, 2.0], 1.0, 3, last_size=0.5)
    assert sim.step_ms == pytest.approx(8.0)
    spans = {(s.kind, s.stage, s.micro): s.duration_ms for s in sim.timeline.spans}
    assert spans[("forward", 0, 2)] == spans[("forward", 1, 2)] == pytest.approx(1.0)
    assert spans[("copy", 0, 2)] == pytest.approx(0.5)
    assert spans[("forward", 0, 1)] == 2.0 and spans[("copy", 0, 1)] == 1.0


def test_the_hosts_issue_time_is_not_scaled() -> None:
    # One forward task on one device, issue-bound: launching a shorter
    # micro-batch takes the host as long.
    issue = {("forward", 0): 3.0}
    sim = simulate([1.0], 0.0, 2, issue_times=issue, last_size=0.5)
    assert [s.issue_ms for s in sim.timeline.spans if s.kind == "forward"] == [3.0, 3.0]
    assert sim.issue_ms == pytest.approx(6.0)


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, math.nan, True, "half"])
def test_a_last_size_outside_0_1_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"last_size .* in \(0, 1\]"):
        simulate(STAGES, 0.0, 3, last_size=bad)


@pytest.mark.parametrize(("overlap", "labels"), [(True, ["a", "b"]), (False, ["host", "host"])])
@pytest.mark.parametrize("batch", [7, 3, 1])
def test_the_doctors_fit_check_costs_the_short_last_micro_batch(
    overlap: bool, labels: list[str], batch: int
) -> None:
    # A "measured" step of ``batch`` images in micro-batches of 2 that is the
    # model's own: the fitted costs predict it exactly. The fit's medians
    # were a short micro-batch's (1 image) or between a full and a short
    # one's (3 images), which simulate then scaled down again: 25% under.
    micros, last = micro_batches(batch, 2)
    measured = simulate(
        STAGES, 0.5, micros, overlap=overlap, backward=True, devices=labels, last_size=last
    )
    (row,) = costfit.validate({2: measured.timeline}, 2, batch, overlap, labels)
    assert row["micro_batches"] == micros and row["measured_ms"] == measured.step_ms
    assert row["error"] == pytest.approx(0.0, abs=1e-12)
    assert row["scaled_error"] == pytest.approx(0.0, abs=1e-12)


def test_a_fit_counts_the_short_last_micro_batch_as_a_full_one() -> None:
    from mpstream.observe.fitting import fit

    micros, last = micro_batches(3, 2)
    measured = simulate(STAGES, 0.5, micros, backward=True, last_size=last)
    costs = fit(measured.timeline, last)
    torch.testing.assert_close(costs.stage_times, list(STAGES))
    torch.testing.assert_close(costs.copy_times, [(0.5, 0.5)])
    with pytest.raises(ValueError, match=r"last_size must be in \(0, 1\]"):
        fit(measured.timeline, 0)


class _Tiny(nn.Module):
    """Stands in for the tutorial's ResNet50: the costs come from the fake profile."""

    def __init__(self, dev0: torch.device, dev1: torch.device, split: int, classes: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(classes))

    def forward(self, x: Tensor) -> Tensor:
        return x.flatten(1).mean(1, keepdim=True) * self.w


def test_the_tutorials_validation_costs_the_short_last_micro_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The CPU model (one host, nothing overlaps): a step of 7 images in
    # micro-batches of 2 is 3.5 full micro-batches' costs, measured so.
    config = dataclasses.replace(QUICK, batch_size=7, image_w=2, image_h=2, warmup=0)
    measured = 3.5 * FULL
    prof = types.SimpleNamespace(
        summary=lambda echo: types.SimpleNamespace(per_run=[{"makespan_ms": measured}])
    )

    @contextlib.contextmanager
    def profile(model: nn.Module) -> Iterator[Any]:
        yield prof

    monkeypatch.setattr(analysis.tutorial, "StreamPipelineResNet50", _Tiny)
    monkeypatch.setattr(analysis, "profile", profile)
    monkeypatch.setattr(analysis, "fit", lambda p, last: Costs(list(STAGES), [(0.0, 0.0)]))
    cpu = torch.device("cpu")
    (row,) = analysis.validate_cost_model(cpu, cpu, config, [2], repeat=1)
    assert row["micro_batches"] == 4
    assert row["predicted_ms"] == pytest.approx(measured) and row["error"] == pytest.approx(0.0)


def test_predict_costs_the_last_micro_batch_and_the_single_device_by_their_share() -> None:
    # predict_scaling and the doctor's GPU predictions counted ceil(batch /
    # split) full micro-batches, on the pipeline and on the one device.
    from mpstream.observe.scaling import predict

    layers = [(1.0, 2.0), (0.5, 1.5), (0.25, 0.75)]
    chunks, last = micro_batches(10, 4)
    one = predict(layers, 1, chunks, last_size=last)
    work = sum(f + b for f, b in layers)
    assert one.step_ms == pytest.approx(2.5 * work)
    assert one.single_device_ms == pytest.approx(2.5 * work)
    two = predict(layers, 2, chunks, last_size=last)
    full = predict(layers, 2, chunks)
    assert two.step_ms < full.step_ms
    assert two.single_device_ms == pytest.approx(2.5 * work)

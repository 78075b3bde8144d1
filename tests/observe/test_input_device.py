"""``simulate(input_device=...)``: a batch off the first stage's device is
copied in, as ``pipe.schedule_for(micros, input_device)`` schedules it;
``predict(input_device=...)`` prices it as ``simulate`` does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpstream import Pipe, predict, simulate
from mpstream.observe.cost_model import Simulation
from mpstream.schedules import Kind, Schedule

COSTS = [(1.0, 1.0, 1.0)] * 3


def _pipe(schedule: str) -> Pipe:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    pipe = Pipe(model, chunks=4, balance=[1, 1, 1], devices=["cpu"] * 3, schedule=schedule)
    pipe(torch.randn(8, 4))  # split: schedule_for needs the stage graph
    return pipe


def _copies(sim: Simulation) -> list[tuple[str, int, int, int]]:
    return [(s.kind, s.stage, s.micro, s.peer) for s in sim.timeline.spans if s.peer != -1]


def _scheduled(sched: Schedule) -> list[tuple[str, int, int, int]]:
    copies = (Kind.COPY, Kind.COPY_GRAD)
    return [(t.kind.label, t.stage, t.micro, t.peer) for t in sched.tasks if t.kind in copies]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("where", ["cpu", "cuda:0", torch.device("cuda:0"), None])
def test_the_simulated_copies_are_the_pipes(
    schedule: str, training: bool, where: str | torch.device | None
) -> None:
    pipe = _pipe(schedule)
    sched = pipe.schedule_for(4, where or "cpu", training_step=training)
    sim = simulate(
        COSTS,
        0.5,
        4,
        schedule if training else "gpipe",
        backward=training,
        devices=["cpu"] * 3,
        input_device=where,
    )
    assert _copies(sim) == _scheduled(sched)
    # The stages all share the CPU: a copy only where the batch is elsewhere.
    assert bool(_copies(sim)) == (where is not None and str(where) != "cpu")


def test_the_batch_off_every_stage_costs_its_copies() -> None:
    on = simulate([(1.0, 2.0)] * 2, 0.5, 4, "1f1b", devices=["gpu0", "gpu1"])
    off = simulate([(1.0, 2.0)] * 2, 0.5, 4, "1f1b", devices=["gpu0", "gpu1"], input_device="cpu")
    assert off.step_ms == on.step_ms + 0.5  # the first micro-batch's copy in; the rest hide
    inputs = [s for s in off.timeline.spans if s.stage == -1]
    assert [(s.micro, s.stream) for s in inputs] == [(m, "io@gpu0") for m in range(4)]
    # The batch on the second stage's device: copied to the first.
    other = simulate(
        [(1.0, 2.0)] * 2, 0.5, 4, "1f1b", devices=["gpu0", "gpu1"], input_device="gpu1"
    )
    assert [s.peer for s in other.timeline.spans if s.stage == -1] == [0] * 4


def test_a_mapping_prices_the_batchs_copy() -> None:
    devices = ["gpu0", "gpu1"]
    sim = simulate([1.0, 1.0], {(-1, 0): 3.0, (0, 1): 0.5}, 1, devices=devices, input_device="cpu")
    assert sim.step_ms == 3.0 + 1.0 + 0.5 + 1.0
    with pytest.raises(ValueError, match=r"hops \[\(-1, 0\)\] that the stage graph"):
        simulate([1.0, 1.0], {(-1, 0): 3.0}, 1, devices=devices)  # the batch is on gpu0


def test_default_streams_block_the_receiving_device_alone() -> None:
    # On default streams the copy from a device no stage is on holds the
    # first stage's stream only.
    sim = simulate([1.0, 1.0], 0.5, 2, overlap=False, devices=["a", "b"], input_device="host")
    rows = {s.stream for s in sim.timeline.spans if s.stage == -1}
    assert rows == {"a"}


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, TypeError, "input_device is where the batch sits, a label as devices= lists them"),
        ("  ", ValueError, "input_device is empty"),
    ],
)
def test_a_bad_input_device_is_refused(value: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        simulate([1.0, 1.0], 0.5, 2, input_device=value)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        predict([1.0, 1.0], 2, 2, input_device=value)  # type: ignore[arg-type]


LAYERS = [(1.0, 2.0), (0.5, 1.0), (1.5, 1.0), (1.0, 2.0)]


@pytest.mark.parametrize("copy_times", [0.5, (0.5, 0.25), [0.5]])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize("where", [None, "cpu", torch.device("cpu"), "device0", "device1"])
def test_predict_prices_the_batch_s_copies_as_simulate_does(
    copy_times: object, schedule: str, where: str | torch.device | None
) -> None:
    pred = predict(
        LAYERS, 2, 4, copy_times=copy_times, balance=[2, 2], schedule=schedule,  # type: ignore[arg-type]
        input_device=where, last_size=0.5,
    )  # fmt: skip
    sim = simulate(
        [(1.5, 3.0), (2.5, 3.0)], copy_times, 4, schedule,  # type: ignore[arg-type]
        input_device=where, last_size=0.5,
    )  # fmt: skip
    assert pred.step_ms == sim.step_ms
    assert pred.simulation.timeline.spans == sim.timeline.spans
    # The batch off the first stage's device, at a copy time: copied in.
    off = where is not None and str(where) != "device0" and not isinstance(copy_times, list)
    assert any(s.stage == -1 for s in sim.timeline.spans if s.duration_ms > 0) == off


@pytest.mark.parametrize("issue_times", [None, [(0.25, 0.25)] * 4])
def test_predict_s_single_device_copies_the_whole_batch_in_first(
    issue_times: list[tuple[float, float]] | None,
) -> None:
    on = predict(LAYERS, 2, 4, copy_times=0.5, issue_times=issue_times)
    off = predict(LAYERS, 2, 4, copy_times=0.5, issue_times=issue_times, input_device="cpu")
    # Four micro-batches' copies in, none hidden behind compute.
    assert off.single_device_ms == on.single_device_ms + 4 * 0.5
    assert off.step_ms == on.step_ms + 0.5  # the pipeline hides all but the first
    listed = predict(LAYERS, 2, 4, copy_times=[0.5], input_device="cpu")
    assert listed.single_device_ms == on.single_device_ms  # a per-boundary list: no price


def test_predict_takes_a_mapping_of_copy_times_as_simulate_does() -> None:
    # The batch's copy in at its own price, beside the boundaries' (a
    # per-boundary list cannot give it one).
    hops = {(0, 1): 0.5, (-1, 0): (0.25, 0.0)}
    pred = predict(LAYERS, 2, 4, copy_times=hops, balance=[2, 2], input_device="cpu")
    sim = simulate([(1.5, 3.0), (2.5, 3.0)], hops, 4, input_device="cpu")
    assert pred.simulation.timeline.spans == sim.timeline.spans
    on = predict(LAYERS, 2, 4, copy_times=[0.5], balance=[2, 2])
    assert pred.single_device_ms == on.single_device_ms + 4 * 0.25

"""The graph launches :func:`~mpstream.observe.compare.graph_launches` counts
for a schedule are the replays one ``train_step`` over graphed stages makes
(emulated graphs count each replay as a launch), on every schedule; the
comparison's table names its units, and its idle share is the devices'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.observe.compare import Comparison, compare, graph_launches, table
from mpstream.observe.cost_model import simulate
from mpstream.runtime.graphed import Emulated
from mpstream.schedules import SCHEDULES, placement_of
from tests.helpers import mlp

RESULTS = Path(__file__).parents[2] / "docs/results/cpu-quick"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_graph_launches_are_the_replays_of_a_step(schedule: str) -> None:
    several = placement_of(schedule) != "stage"  # two stages per rank
    backend = Emulated()
    pipe = Pipe(
        mlp([6, 12, 12, 8, 4]).double(), split_size=3, schedule=schedule,
        balance=[2, 2, 2, 2] if several else [4, 4], devices=["cpu"] * (4 if several else 2),
        virtual_stages=2 if several else None, graphs=backend,
    )  # fmt: skip
    x, y = torch.randn(10, 6, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)
    pipe.train_step(x, y, nn.MSELoss())  # captures
    before = backend.replays
    pipe.train_step(x, y, nn.MSELoss())
    sched = pipe.schedule_for(4, x.device, training_step=True, target_device=y.device)
    # Without a device: no zero_grad or optimizer-step graph.
    assert backend.replays - before == graph_launches(sched, 0)


def test_table_names_the_measured_peak_in_the_unit_it_divides_by() -> None:
    row = Comparison(
        "gpipe", 1.0, 0.0, [1], [1], ["d0"], simulate([(1.0, 1.0)]), measured={"stage0": 3 * 2**20}
    )
    head, _, line = table([row]).splitlines()
    assert "measured peak (MiB)" in head and line.endswith(" stage0 3.0 |")


def test_table_labels_each_measured_peak_with_its_stage_or_device() -> None:
    # A pipe with CPU and CUDA stages: saved bytes per CPU stage, the
    # allocator's peak per GPU; a row not measured is left blank.
    mixed = {"stage0": 2**20, "stage1": 2**19, "cuda:0": 5 * 2**20}
    rows = [
        Comparison(name, 1.0, 0.0, [1, 1, 1], [1, 1, 1], ["cpu", "cpu", "cuda:0"],
                   simulate([(1.0, 1.0)] * 3), measured=measured)
        for name, measured in (("gpipe", mixed), ("1f1b", {}))
    ]  # fmt: skip
    _, _, gpipe, one_f = table(rows).splitlines()
    assert gpipe.endswith("| stage0 1.0, stage1 0.5, cuda:0 5.0 |")
    assert one_f.endswith("|  |")


def test_the_stored_cpu_log_has_the_table_head_the_code_prints() -> None:
    row = Comparison("gpipe", 1.0, 0.0, [1], [1], ["d0"], simulate([(1.0, 1.0)]), measured={"s": 1})
    head = table([row]).splitlines()[0]
    log = RESULTS / "schedules/schedules.log"
    # The stored log predates the idle column's name: its "bubble" is the
    # same devices' idle share (README.md and docs/schedules.md say so).
    stored = head.replace("| device idle |", "| bubble |")
    assert [h for h in log.read_text().splitlines() if h.startswith("| schedule |")] == [stored]


def test_a_comparison_names_the_devices_idle_share_not_the_stages() -> None:
    # Four stages on two devices: a stage waiting while the other on its
    # device computes idles no device, so the two shares differ; the
    # comparison holds the devices', as the stored unit-cost run did under
    # its old key.
    rows = compare([(1.0, 1.0, 1.0)] * 4, 2, 8)
    stored = json.loads((RESULTS / "schedules-uniform/schedules.json").read_text())
    assert [r.schedule for r in rows] == [s["schedule"] for s in stored["schedules"]]
    for row, old in zip(rows, stored["schedules"]):
        summary = row.simulation.timeline.summary(echo=False)
        assert row.device_idle_fraction == summary.device_idle_fraction
        assert row.device_idle_fraction == pytest.approx(old["bubble_fraction"])
        assert summary.bubble_fraction > summary.device_idle_fraction
    assert "| device idle |" in table(rows).splitlines()[0]

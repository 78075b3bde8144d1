"""Doctor step 7's graphed-stages table, run on the CPU with emulated graphs:
every schedule eager, graphed and captured, beside the single device."""

from __future__ import annotations

from pathlib import Path

import torch

from mpstream.doctor import graphed
from mpstream.doctor.diagnosis import PASS, TINY, Context
from mpstream.runtime.graphed import Emulated

CPU = torch.device("cpu")


def test_each_schedule_is_measured_three_ways_beside_the_single_device(tmp_path: Path) -> None:
    ctx = Context((CPU, CPU), TINY, "resnet50", tmp_path, tmp_path)
    ticks: list[int] = []
    rows = graphed.schedule_rows(
        ctx, Emulated(), schedules=("gpipe", "zb_h1"), tick=lambda: ticks.append(1)
    )
    assert [r["schedule"] for r in rows] == [graphed.SINGLE, "gpipe", "zb_h1"]
    assert len(ticks) == 2 + 3 * 2
    assert graphed.GRAPHED not in rows[0]
    for row in rows[1:]:
        eager, stages, whole = row[graphed.EAGER], row[graphed.GRAPHED], row[graphed.CAPTURED]
        for m in (eager, stages, whole):
            assert m["step_ms"] > 0 and 0 < m["issue_share"] <= 1.0 + 1e-9
            assert m["peak_bytes"] is None  # allocator statistics exist on a GPU only
        assert stages["graphed"] and stages["pool_bytes"] == 0  # no device memory on a CPU
    # Slots: fill-drain keeps both micro-batches in flight on each stage.
    assert rows[1][graphed.GRAPHED]["slots"] == [2, 2]
    zb = rows[2][graphed.GRAPHED]
    assert zb["passes"][1] == ["forward", "backward", "weight"]
    checks = graphed.schedule_checks(rows, cuda=False, split=TINY.experiment.split_size)
    names = ["graphed stages, gpipe, split 2", "graphed stages, zb_h1, split 2"]
    assert [c.name for c in checks] == names
    assert all(c.status == PASS for c in checks)
    assert "the captured step (target <= 1.15x: a GPU target)" in checks[0].detail
    assert "x the single device captured" in checks[0].detail

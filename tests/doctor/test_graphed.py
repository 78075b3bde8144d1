"""Doctor step 7's graphed-stages table, run on the CPU with emulated graphs:
every schedule eager, graphed, captured and captured over graphed stages, beside the
single device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mpstream.doctor import graphed
from mpstream.doctor.diagnosis import FAIL, PASS, TINY, Context
from mpstream.doctor.experiment import config_for
from mpstream.runtime.graphed import Emulated

CPU = torch.device("cpu")
CUDA = torch.device("cuda:0")  # a name only: nothing runs on it here


def test_each_schedule_is_measured_four_ways_beside_the_single_device(tmp_path: Path) -> None:
    ctx = Context((CPU, CPU), TINY, "resnet50", tmp_path, tmp_path)
    ticks: list[int] = []
    rows = graphed.schedule_rows(
        ctx, Emulated(), schedules=("gpipe", "zb_h1"), tick=lambda: ticks.append(1)
    )
    assert [r["schedule"] for r in rows] == [graphed.SINGLE, "gpipe", "zb_h1"]
    # A captured step's input and target buffers: copies of the batch (float32).
    config = config_for(ctx)
    batch_bytes = 4 * config.batch_size * (3 * config.image_w * config.image_h + config.num_classes)
    assert rows[0][graphed.CAPTURED]["static_bytes"] == batch_bytes
    assert len(ticks) == 2 + 4 * 2
    assert graphed.GRAPHED not in rows[0] and graphed.GRAPHED_STEP not in rows[0]
    for row in rows[1:]:
        eager, stages, whole = row[graphed.EAGER], row[graphed.GRAPHED], row[graphed.CAPTURED]
        around = row[graphed.GRAPHED_STEP]
        assert around["launches"] == whole["launches"] == 0  # the CPU runs them eagerly
        for m in (eager, stages, whole, around):
            assert m["step_ms"] > 0 and 0 < m["issue_share"] <= 1.0 + 1e-9
            assert m["peak_reserved_bytes"] is None  # allocator statistics: on a GPU only
        assert stages["graphed"] and stages["pool_bytes"] == 0  # no device memory on a CPU
        assert stages["static_bytes"] > 0  # the graphs' buffers outside the pools
        assert (whole["pool_bytes"], whole["static_bytes"]) == (0, batch_bytes)
    # Slots: fill-drain keeps both micro-batches in flight on each stage.
    assert rows[1][graphed.GRAPHED]["slots"] == [2, 2]
    zb = rows[2][graphed.GRAPHED]
    assert zb["passes"][1] == ["forward", "backward", "weight"]
    checks = graphed.schedule_checks(rows, cuda=False, split=TINY.experiment.split_size)
    names = [
        "graphed stages' baseline: the single device",
        "graphed stages, gpipe, split 2",
        "graphed stages, zb_h1, split 2",
    ]
    assert [c.name for c in checks] == names
    assert all(c.status == PASS for c in checks)
    assert "captured as one graph" in checks[0].detail
    held = ": its graph's pool 0 MiB and input and target buffers outside it"
    assert f"- captured{held}" in checks[0].detail and f"captured -{held}" in checks[1].detail
    assert "the captured step (target <= 1.15x: a GPU target)" in checks[1].detail
    assert "x the single device captured" in checks[1].detail
    assert "captured over graphed stages" in checks[1].detail
    assert "x one graph" in checks[1].detail
    # Per replayed task (a forward and a backward per stage and micro-batch; zb_h1's W too).
    micros = rows[1][graphed.GRAPHED]["replayed_tasks"] // 4
    assert micros >= 1 and rows[2][graphed.GRAPHED]["replayed_tasks"] == 6 * micros
    assert "us per replayed task over" in checks[1].detail


def test_host_time_per_task_and_graph_pools_are_held_against_their_targets() -> None:
    timed = {"step_ms": 10.0, "issue_ms": 5.0, "issue_share": 0.5, "launches": 0}
    eager = {**timed, "peak_reserved_bytes": {"cuda:0": 1000 * 2**20}}
    captured: dict[str, Any] = {**timed, "peak_reserved_bytes": {"cuda:0": 900 * 2**20},
                "pool_bytes": 700 * 2**20, "static_bytes": 20 * 2**20}  # fmt: skip
    stages = {
        **timed, "peak_reserved_bytes": {"cuda:0": 1400 * 2**20}, "graphed": True,
        "reasons": [], "slots": [2, 1], "pool_bytes": 1000 * 2**20, "grad_bytes": 0,
        "static_bytes": 100 * 2**20,
        "replayed_tasks": 50, "host_us_per_task": 100.0,
    }  # fmt: skip
    rows = [
        {"schedule": graphed.SINGLE, graphed.EAGER: timed, graphed.CAPTURED: timed},
        {"schedule": "1f1b", graphed.EAGER: eager, graphed.GRAPHED: stages,
         graphed.CAPTURED: captured, graphed.GRAPHED_STEP: None},
    ]  # fmt: skip
    detail = graphed.schedule_checks(rows, cuda=True, split=8)[1].detail
    assert "host 100 us per replayed task over 50 (target <= 50 us: missed)" in detail
    assert "of which graph pools 1000 MiB and static buffers outside them 100 MiB" in detail
    held = "its graph's pool 700 MiB and input and target buffers outside it 20 MiB"
    assert f"(eager 1000 MiB, captured 900 MiB: {held})" in detail
    assert "1.10x the eager peak in graph pools and static buffers (target <= 1.25x: met)" in detail


def test_a_measurement_that_raises_fails_its_line_and_keeps_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = Context((CPU, CPU), TINY, "resnet50", tmp_path, tmp_path)
    timed = {"step_ms": 2.0, "issue_ms": 1.0, "issue_share": 0.5, "peak_reserved_bytes": None}
    stages = {**timed, "graphed": True, "reasons": [], "slots": [2, 2], "pool_bytes": 0}

    fallen = {**stages, "graphed": False, "reasons": ["capture failed: RuntimeError: sync"]}

    def fake(ctx: Context, schedule: str | None, variant: str, backend: Any) -> dict[str, Any]:
        if variant == graphed.CAPTURED and schedule == "1f1b":
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        if variant == graphed.GRAPHED:
            return fallen if schedule == "zb_h1" else stages
        return timed

    monkeypatch.setattr(graphed, "measure", fake)
    rows = graphed.schedule_rows(ctx, schedules=("gpipe", "1f1b", "zb_h1"))
    assert rows[2][graphed.CAPTURED] == {
        "error": "RuntimeError: operation not permitted when stream is capturing"
    }
    checks = graphed.schedule_checks(rows, cuda=True, split=2)
    assert [c.status for c in checks] == [PASS, PASS, FAIL, FAIL]
    assert "captured step: RuntimeError" in checks[2].detail
    assert "1.00x eager (target <= 0.3x: missed)" in checks[2].detail
    # A stage that fell back to eager makes its figures not graphed ones.
    assert "EAGER STAGES: capture failed" in checks[3].detail


def test_a_failed_empty_cache_fails_its_line_and_the_next_measurement_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A capture that left the allocator believing it is still underway made
    # empty_cache assert; the step goes on and the line says so.
    ctx = Context((CUDA, CUDA), TINY, "resnet50", tmp_path, tmp_path)
    timed = {"step_ms": 2.0, "issue_ms": 1.0, "issue_share": 0.5, "peak_reserved_bytes": None}
    stages = {**timed, "graphed": True, "reasons": [], "slots": [2, 2], "pool_bytes": 0}
    measured: list[tuple[str | None, str]] = []

    def fake(ctx: Context, schedule: str | None, variant: str, backend: Any) -> dict[str, Any]:
        measured.append((schedule, variant))
        if schedule == "gpipe" and variant == graphed.GRAPHED:
            raise RuntimeError("capture failed")
        return stages if variant == graphed.GRAPHED else timed

    def assertion() -> None:
        raise RuntimeError("captures_underway.empty() INTERNAL ASSERT FAILED\nat ...")

    monkeypatch.setattr(graphed, "measure", fake)
    monkeypatch.setattr(torch.cuda, "empty_cache", assertion)
    rows = graphed.schedule_rows(ctx, schedules=("gpipe", "1f1b"))
    assert len(measured) == 2 + 4 * 2  # every measurement ran
    failed = rows[1][graphed.GRAPHED]
    assert failed["cache"] == [
        "empty_cache after the error: RuntimeError: "
        "captures_underway.empty() INTERNAL ASSERT FAILED"
    ]
    checks = graphed.schedule_checks(rows, cuda=True, split=2)
    assert checks[1].status == FAIL
    assert "graphed stages: empty_cache after the error: RuntimeError" in checks[1].detail
    assert checks[2].status == PASS


def test_a_failed_empty_cache_is_collected_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    # What measure does around each variant (its row then holds "cache").
    failures: list[str] = []

    def assertion() -> None:
        raise RuntimeError("captures_underway.empty() INTERNAL ASSERT FAILED")

    monkeypatch.setattr(torch.cuda, "empty_cache", assertion)
    graphed._empty_cache("before", failures)
    assert failures == [
        "empty_cache before: RuntimeError: captures_underway.empty() INTERNAL ASSERT FAILED"
    ]

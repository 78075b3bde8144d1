"""``--order FILE`` of ``mpstream schedules`` and ``mpstream trace``
(:mod:`mpstream.cli.orders`): an order written by hand, simulated, drawn and
traced, and refused with the library's errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpstream import cli
from mpstream.schedules import PLACEMENTS, Schedule

from .test_main import TINY


def _written(tmp_path: Path, text: str) -> str:
    path = tmp_path / "order.txt"
    path.write_text(text)
    return str(path)


def test_schedules_draws_your_order_beside_the_built_in_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1F1B's order, as a researcher starts from it: the row must be 1F1B's,
    # and the order sets the stages and micro-batches.
    text = str(Schedule("1f1b", 3, 6, [False] * 3, backward=True))
    # Comments on lines of their own and after actions are left out.
    order = _written(tmp_path, "# 1F1B, 3 stages\n" + text.replace(" ", "  # warm-up\n", 5))
    out = tmp_path / "o"
    assert cli.main(["schedules", "--uniform", "--order", order, "--out", str(out)]) == 0
    assert "3 stages on 2 devices, 6 micro-batches" in capsys.readouterr().out
    doc = json.loads((out / "schedules.json").read_text())
    assert (doc["order_file"], doc["order"]) == (order, text)
    rows = {r["schedule"]: r for r in doc["schedules"]}
    mine, built_in = rows.pop("your order"), rows["1f1b"]
    for key in ("step_ms", "device_idle_fraction", "live_per_stage", "held_per_stage", "devices"):
        assert mine[key] == built_in[key], key
    assert (out / "schedules.png").read_bytes().startswith(b"\x89PNG")


def test_schedules_measures_your_order_on_resnet50(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1F1B's order again: a real step in it saves what 1F1B's does.
    text = str(Schedule("1f1b", 2, 2, [False] * 2, backward=True))
    order = _written(tmp_path, text)
    args = ["schedules", "--order", order, "--image-size", "32", "--no-plots"]
    args += ["--device", "cpu", "--out", str(tmp_path / "o")]  # peaks per stage on the CPU
    assert cli.main(args) == 0
    assert "2 stages on 2 devices, 2 micro-batches" in capsys.readouterr().out
    doc = json.loads((tmp_path / "o" / "schedules.json").read_text())
    rows = {r["schedule"]: r for r in doc["schedules"]}
    mine = rows["your order"]["measured_peak_bytes"]
    assert set(mine) == {"stage0", "stage1"} and all(b > 0 for b in mine.values())
    assert mine == rows["1f1b"]["measured_peak_bytes"]
    assert rows["your order"]["step_ms"] == rows["1f1b"]["step_ms"]


@pytest.mark.parametrize(
    ("text", "options", "message"),
    [
        (
            "F0m0 F1m0 B1m0 X0m0",
            [],
            "'X0m0' is not a schedule action: write F, B or W, the stage, 'm' and the micro-batch",
        ),
        (
            "F0m0 F1m0 B0m0 B1m0",
            [],
            "invalid schedule order: B0m0 needs B1m0 (the gradient of stage 0's output comes "
            "from stage 1), which comes later (step 3)\nstage x step grid of the order (kind "
            "and micro-batch; [ ] marks step 2):",
        ),
        (
            "F0m0 F1m0 B1m0 B0m0",
            ["--stages", "3"],
            "the order is for 2 stages (stages 0-1), but --stages 3: drop it, or give an "
            "order for 3 stages",
        ),
        (
            "F0m0 F1m0 B1m0 B0m0",
            ["--micro-batches", "2"],
            "the order is for 1 micro-batch (m0), but --micro-batches 2: drop "
            "it, or give an order for 2",
        ),
        (
            "F0m0 F1m0 F0m1 B1m0 F1m1 B0m0 B1m1 B0m1",
            ["--micro-batches", "3"],
            "the order is for 2 micro-batches (m0-m1), but --micro-batches 3: drop "
            "it, or give an order for 3",
        ),
        ("F0m0 F2m0 B2m0 B0m0", [], "the schedule order has no action of stage 1"),
        ("", [], "the schedule order is empty"),
    ],
)
def test_schedules_refuses_an_order_that_does_not_fit(
    text: str,
    options: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    order = _written(tmp_path, text)
    args = ["schedules", "--uniform", "--order", order, *options, "--out", str(tmp_path / "o")]
    assert cli.main(args) == 2
    assert f"mpstream schedules: error: --order {order}: {message}" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("name", "placement"),
    [(n, p) for n, p in PLACEMENTS.items() if p != "stage"],  # interleaved_1f1b, zbv, ...
)
def test_schedules_places_an_order_written_for_several_stages_per_device(
    name: str, placement: str, tmp_path: Path
) -> None:
    # A built-in schedule's order, written out: placed as its schedule
    # places its stages, its row is the built-in's.
    text = str(Schedule(name, 4, 4, [False] * 4, backward=True, virtual_stages=2))
    order = _written(tmp_path, text)
    runs = {}
    for given in ("stage", placement):
        out = tmp_path / given
        args = ["schedules", "--uniform", "--order", order, "--order-placement", given]
        assert cli.main([*args, "--no-plots", "--out", str(out)]) == 0
        doc = json.loads((out / "schedules.json").read_text())
        assert doc["order_placement"] == given
        runs[given] = {r["schedule"]: r for r in doc["schedules"]}
    mine, built_in = runs[placement]["your order"], runs[placement][name]
    keys = ("step_ms", "device_idle_fraction", "peak_activations_per_device", "devices")
    for key in (*keys, "live_per_stage", "held_per_stage", "graph_launches"):
        assert mine[key] == built_in[key], key
    # In contiguous runs (the default) the same order is another pipeline.
    chained = runs["stage"]["your order"]
    assert chained["devices"] == ["device0", "device0", "device1", "device1"]
    assert any(chained[key] != built_in[key] for key in keys)


@pytest.mark.parametrize(
    ("stages", "options", "message"),
    [
        (
            3,
            ["--order-placement", "v"],
            "--order-placement v: V placement: 3 stages need to be even and at least twice "
            "the 2 devices; give an order for 4 stages, or another --order-placement",
        ),
        (
            3,
            ["--order-placement", "round_robin"],
            "--order-placement round_robin: round-robin placement: 3 stages do not divide "
            "evenly over 2 devices; give --num-devices 1 or 3, or another --order-placement",
        ),
        (
            4,
            ["--order-placement", "v", "--num-devices", "3"],
            "--order-placement v: V placement: 4 stages need to be even and at least twice "
            "the 3 devices; give --num-devices 1 or 2, or another --order-placement",
        ),
    ],
)
def test_schedules_refuses_an_order_its_placement_cannot_take(
    stages: int,
    options: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    order = _written(tmp_path, str(Schedule("1f1b", stages, 2, [False] * stages, backward=True)))
    args = ["schedules", "--uniform", "--order", order, *options, "--out", str(tmp_path / "o")]
    assert cli.main(args) == 2
    assert f"mpstream schedules: error: --order {order} {message}" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_an_order_placement_without_an_order_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["schedules", "--uniform", "--order-placement", "v", "--out", str(tmp_path / "o")]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "--order-placement v places the stages of your --order: give --order FILE" in err


def test_an_unreadable_order_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "none.txt")
    args = ["schedules", "--uniform", "--order", missing, "--out", str(tmp_path / "o")]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"error: --order {missing}: cannot read it (No such file or directory)" in err


@pytest.mark.parametrize(
    ("text", "options", "message"),
    [
        (
            "F0m0 F1m0 B1m0 B0m0",
            [],
            "the order is for 1 micro-batch (m0), but --batch-size 4 in "
            "micro-batches of 2 (--split-size) makes 2: give an order for 2, or a "
            "--split-size making as many as the order covers",
        ),
        (
            "F0m0 F1m0 F2m0 B2m0 B1m0 B0m0",
            [],
            "the order is for 3 stages (stages 0-2), but the tutorial's model has 2 stages",
        ),
        (
            "F0m0 F1m0 F0m1 F1m1 B1m0 B0m0 B1m1 B0m1",
            ["--split-sizes", "2,4"],
            "--split-sizes with --order: an order covers one micro-batch count",
        ),
    ],
)
def test_trace_refuses_an_order_before_tracing(
    text: str,
    options: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    order = _written(tmp_path, text)
    tiny = [a for a in TINY if a != "--no-progress"]
    args = ["trace", *tiny, "--order", order, *options, "--out", str(tmp_path / "o")]
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_trace_traces_train_step_in_your_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Zero-bubble's split backward: the traced steps have weight passes,
    # and the cost model fits and simulates them.
    order = _written(tmp_path, "F0m0 F1m0 B1m0 F0m1 W1m0 B0m0 F1m1 B1m1 W1m1 B0m1")
    tiny = [a for a in TINY if a != "--no-progress"]
    args = ["trace", *tiny, "--num-batches", "1", "--order", order, "--out", str(tmp_path)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert f"trace of train_step in your order ({order}) (measured)" in out
    assert "predictions (cost model, not measured; fill-drain, not your order; layers" in out
    trace = json.loads((tmp_path / "trace.json").read_text())
    tasks = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"weight s1 mb0", "weight s1 mb1"} <= tasks
    assert not any(t.startswith("weight s0") for t in tasks)
    report = json.loads((tmp_path / "trace_report.json").read_text())
    assert report["order"] == "F0m0 F1m0 B1m0 F0m1 W1m0 B0m0 F1m1 B1m1 W1m1 B0m1"
    (row,) = report["cost_model_validation"]
    assert row["split_size"] == 2
    # Stage 1's backward is split, stage 0's whole: forward, input gradient,
    # weight gradient and a whole backward (the fit's quadruples), stage 0's
    # whole one as measured, stage 1's (never run whole) its two passes.
    (_, b0, w0, whole0), (_, b1, w1, whole1) = row["stage_times_ms"]
    assert w0 == 0 and whole0 == b0
    assert whole1 == pytest.approx(b1 + w1)

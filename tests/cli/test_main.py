"""``mpstream tune`` and ``mpstream trace`` end to end at a tiny size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import mpstream
from mpstream import cli

# No --num-batches: tune takes none (it times one mini-batch per step).
TINY = [
    "--batch-size", "4", "--image-size", "32", "--num-classes", "10",
    "--split-size", "2", "--repeat", "1", "--warmup", "0", "--no-progress",
    "--devices", "cpu,cpu",  # the CPU even where a GPU exists: these check the CPU path
]  # fmt: skip
# tune sweeps split sizes: it has no main --split-size.
TUNE = [a for i, a in enumerate(TINY) if "--split-size" not in TINY[max(i - 1, 0) : i + 1]]


def test_tune_writes_the_curve_and_uses_the_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "tune",
        *TUNE,
        "--split-sizes",
        "2,4",
        "--cache",
        str(tmp_path / "c.json"),
        "--out",
        str(tmp_path),
    ]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "best: split size" in out and "from cache" not in out
    doc = json.loads((tmp_path / "tune.json").read_text())
    assert [p["split_size"] for p in doc["curve"]] == [2, 4] and doc["from_cache"] is False
    assert (tmp_path / "tune_tradeoff.png").read_bytes().startswith(b"\x89PNG")
    assert cli.main(args) == 0
    assert "(from cache)" in capsys.readouterr().out
    # The file said nothing of it: cached times read as this run's.
    again = json.loads((tmp_path / "tune.json").read_text())
    assert again["from_cache"] is True and again["curve"] == doc["curve"]


def test_tune_with_balances(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "tune",
        *TUNE,
        "--split-sizes",
        "2",
        "--balances",
        "tutorial,9:14",
        "--no-cache",
        "--out",
        str(tmp_path),
    ]
    assert cli.main(args) == 0
    doc = json.loads((tmp_path / "tune.json").read_text())
    assert [p["balance"] for p in doc["curve"]] == [[11, 12], [9, 14]]


@pytest.mark.parametrize(
    ("balances", "message"), [("5:5", "23 blocks"), ("fast", "not 'tutorial'")]
)
def test_tune_rejects_bad_balances(
    balances: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["tune", *TUNE, "--balances", balances, "--no-cache", "--out", str(tmp_path)]
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err


def test_trace_writes_trace_timeline_and_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = [a for a in TINY if a != "--no-progress"]  # trace shows no progress bar
    args = ["trace", *tiny, "--num-batches", "1", "--split-sizes", "2,4", "--out", str(tmp_path)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "cost model vs measured" in out and "predictions (cost model, not measured" in out
    trace = json.loads((tmp_path / "trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"stage0.compute@cpu", "stage1.compute@cpu"} <= tracks
    assert (tmp_path / "timeline.png").read_bytes().startswith(b"\x89PNG")
    report = json.loads((tmp_path / "trace_report.json").read_text())
    assert [r["split_size"] for r in report["cost_model_validation"]] == [2, 4]
    assert {(r["devices"], r["split"]) for r in report["predictions"]["rows"]} == {
        (2, "tutorial-style"),
        (2, "balanced"),
        (4, "tutorial-style"),
        (4, "balanced"),
    }
    summary = report["trace_summary"]
    assert summary["makespan_ms"] > 0
    # Both stages on the CPU: the per-stage bubble is about 50% with the
    # device hardly idle; the print gave the former alone.
    assert summary["devices"] == 1 and summary["device_idle_fraction"] < 0.5
    assert (
        f"  device_idle_fraction: {summary['device_idle_fraction']}  (2 stages on 1 device)" in out
    )
    assert f"  bubble_fraction: {summary['bubble_fraction']}" in out


def test_trace_summary_lines_show_device_idle_only_where_stages_share_a_device() -> None:
    from mpstream.cli.resnet import summary_lines

    base = {"makespan_ms": 10.0, "bubble_fraction": 0.5, "device_idle_fraction": 0.0}
    base |= {"copy_hidden_fraction": None, "stage_busy_ms": [5.0, 5.0]}
    shared = summary_lines({**base, "devices": 1})
    assert shared[2] == "device_idle_fraction: 0.0  (2 stages on 1 device)"
    apart = summary_lines({**base, "bubble_fraction": 0.2, "devices": 2})
    assert apart == [
        "makespan_ms: 10.0", "bubble_fraction: 0.2", "copy_hidden_fraction: None",
        "stage_busy_ms: [5.0, 5.0]",
    ]  # fmt: skip


def test_schedules_with_unit_costs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["schedules", "--uniform", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "4 stages on 2 devices, 8 micro-batches; unit costs" in out
    # Simulated step times beside measured peaks: the column says which.
    assert "| schedule | step (ms, simulated) | device idle |" in out
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert rows[2:] == list(mpstream.SCHEDULES)
    doc = json.loads((tmp_path / "schedules.json").read_text())
    steps = {r["schedule"]: r["step_ms"] for r in doc["schedules"]}
    assert steps["zb_h1"] < steps["interleaved_1f1b"] < steps["1f1b"] < steps["gpipe"]
    assert steps["zbv"] == steps["dualpipev"] == steps["interleaved_zb"] < steps["zb_h1"]
    # The devices' idle share under its own name: bubble_fraction is the
    # per-stage share, as trace_report.json holds it.
    assert not any("bubble_fraction" in r for r in doc["schedules"])
    idle = {r["schedule"]: r["device_idle_fraction"] for r in doc["schedules"]}
    assert idle["gpipe"] == pytest.approx(12 / 60)  # each device idles 12 of 60 ms
    # Captured over graphed stages: a graph per forward and backward of each
    # of the 4 stages' 8 micro-batches (64), one per weight task where a
    # backward is split (all 32 in zero-bubble, 5 in DualPipe-V), less the
    # first stage's split B, which has no input gradient to compute (8 and
    # 2), and a zero_grad and an optimizer-step graph per device (4).
    launches = {r["schedule"]: r["graph_launches"] for r in doc["schedules"]}
    assert launches == {
        "gpipe": 68, "1f1b": 68, "interleaved_1f1b": 68, "zb_h1": 92, "looped_bfs": 68,
        "interleaved_zb": 92, "zbv": 92, "dualpipev": 71,
    }  # fmt: skip
    peaks = {r["schedule"]: r["peak_activations_per_device"] for r in doc["schedules"]}
    assert peaks["zbv"] == [4, 4] and peaks["dualpipev"] == [5, 5]  # 2p and 2p + 1
    assert (tmp_path / "schedules.png").read_bytes().startswith(b"\x89PNG")


def test_schedules_profiles_and_measures_resnet50(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "schedules",
        "--stages",
        "2",
        "--devices",
        "2",
        "--micro-batches",
        "2",
        "--image-size",
        "32",
        "--no-plots",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
    ]  # fmt: skip  (the CPU even on a GPU machine: peaks are per stage only there)
    (tmp_path / "schedules.png").write_bytes(b"an earlier run's")
    assert cli.main(args) == 0
    assert "ResNet50 (2 images of 32x32 per micro-batch) profiled on" in capsys.readouterr().out
    doc = json.loads((tmp_path / "schedules.json").read_text())
    assert doc["balance"] == [11, 12] and len(doc["stage_costs_ms"][0]) == 3
    for row in doc["schedules"]:
        assert set(row["measured_peak_bytes"]) == {"stage0", "stage1"}
        assert all(b > 0 for b in row["measured_peak_bytes"].values())
    assert not (tmp_path / "schedules.png").exists()


def test_schedules_rejects_more_devices_than_stages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["schedules", "--uniform", "--stages", "2", "--num-devices", "3", "--out", str(tmp_path)]
    assert cli.main(args) == 2
    assert "--num-devices 3 exceeds --stages 2" in capsys.readouterr().err


TINY_BENCH = [
    "bench", "--quick", "--repeat", "1", "--warmup", "0", "--batch-size", "4",
    "--image-size", "32", "--num-batches", "1", "--split-size", "2", "--no-sweep",
    "--num-classes", "10", "--no-plots", "--devices", "cpu,cpu",
]  # fmt: skip


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_the_progress_bar_is_drawn_only_on_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import fcntl
    import pty
    import struct
    import termios

    # Not a terminal (a log file; here, pytest's capture): no bar, no
    # carriage returns; the table still prints.
    assert cli.main([*TINY_BENCH, "--out", str(tmp_path)]) == 0
    logged = capsys.readouterr()
    assert "\r" not in logged.err and "train/s" not in logged.err + logged.out
    assert "speed-up" in logged.out
    command = [sys.executable, "-m", "mpstream", *TINY_BENCH, "--out", str(tmp_path)]
    # A terminal: the bar, redrawn in place (read while it runs: a full
    # pseudo-terminal would block the writer).
    main, child = pty.openpty()
    # A terminal 100 columns wide: at tqdm's 0 columns a bar draws nothing.
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    drawn: list[bytes] = []

    def read() -> None:
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal closed: all read
                return
            if not chunk:
                return
            drawn.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=child, timeout=300)
    finally:
        os.close(child)
        reader.join(timeout=30)
        os.close(main)
    assert done.returncode == 0 and b"speed-up" in done.stdout
    assert b"train" in b"".join(drawn) and b"\r" in b"".join(drawn)


def test_an_error_while_running_is_no_bad_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mpstream.tutorial import bench

    def fails(*_: object, **__: object) -> None:
        raise ValueError("Expected more than 1 value per channel when training")

    monkeypatch.setattr(bench, "run", fails)
    out = tmp_path / "new" / "out"
    # It propagates with its traceback, not as "error:" and exit 2.
    with pytest.raises(ValueError, match="Expected more than 1 value"):
        cli.main([*TINY_BENCH, "--out", str(out)])
    assert "error:" not in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # the --out it made, still empty, is gone


def test_trace_predicts_with_the_batch_where_input_device_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # trace's predictions took the batch on the first stage's device only,
    # unlike predict(input_device=): a batch on the host is copied in.
    import torch

    from mpstream.stages.balance import LayerProfile
    from mpstream.tutorial import analysis

    # Fixed layer costs, so the two runs' predictions differ by the copies in alone.
    def layers(model: object, sample: torch.Tensor, **kwargs: object) -> list[LayerProfile]:
        return [LayerProfile(f"l{i}", 1.0, 2.0, 0, 0, 4000) for i in range(23)]

    monkeypatch.setattr(analysis, "profile_layers", layers)
    monkeypatch.setattr(analysis, "trace_tutorial", lambda *a, **k: {
        "makespan_ms": 1.0, "bubble_fraction": 0.0, "copy_hidden_fraction": 0.0,
        "stage_busy_ms": [1.0, 1.0]})  # fmt: skip
    monkeypatch.setattr(analysis, "validate_cost_model", lambda *a, **k: [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # cuda:0, a device here
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    tiny = [a for a in TINY if a != "--no-progress"]
    reports = {}
    for where in (None, "cpu", "cuda:0"):
        out = tmp_path / str(where)
        given = [] if where is None else ["--input-device", where]
        assert cli.main(["trace", *tiny, "--link-gbps", "2", *given, "--out", str(out)]) == 0
        reports[where] = json.loads((out / "trace_report.json").read_text())["predictions"]
        printed = capsys.readouterr().out
        assert ("the batch on cuda:0, each micro-batch's images copied in" in printed) == (
            where == "cuda:0"
        )
    on, same, off = reports[None], reports["cpu"], reports["cuda:0"]
    assert on["rows"] == same["rows"] and same["input_device"] == "cpu"  # the stages' device
    assert on["input_copy_ms"] is None and off["input_device"] == "cuda:0"
    images = 2 * 3 * 32 * 32 * 4  # one micro-batch of --split-size 2, float32
    assert off["input_copy_ms"] == pytest.approx(images / 2e9 * 1e3)
    for a, b in zip(on["rows"], off["rows"]):
        # Two micro-batches copied in before the single device's step; the
        # pipeline hides the second's behind the first's forward.
        assert b["single_device_ms"] == pytest.approx(
            a["single_device_ms"] + 2 * off["input_copy_ms"]
        )
        assert b["predicted_step_ms"] == pytest.approx(
            a["predicted_step_ms"] + off["input_copy_ms"]
        )

"""``mpstream doctor`` end to end at tiny sizes, the runner, the CLI and the report."""

from __future__ import annotations

import json
import math
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch

from mpstream import cli
from mpstream.doctor import experiment, modelcheck, report, runner
from mpstream.doctor.diagnosis import FAIL, PASS, SKIP, TINY, Check, Context, StepResult
from mpstream.tutorial import bench

ON_GPU = torch.cuda.is_available()


@pytest.mark.skipif(ON_GPU, reason="checks the CPU run: GPU steps SKIP")
def test_doctor_quick_on_cpu_skips_gpu_steps_and_writes_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(runner, "QUICK", TINY)  # every step's code path, at the smallest size
    # The cost model's error depends on timings on a shared CPU: with no
    # limit its verdict is known (PASS), and step 8 is run again below with a
    # limit nothing meets (FAIL). The context it ran with is kept for that.
    monkeypatch.setattr(modelcheck, "MAX_ERROR", math.inf)
    contexts: list[Context] = []
    config_for = experiment.config_for

    def keep_context(c: Context) -> bench.Config:
        contexts.append(c)
        return config_for(c)

    monkeypatch.setattr(modelcheck, "config_for", keep_context)
    (tmp_path / "overlap.png").write_bytes(b"stale")  # from an earlier GPU run
    code = cli.main(["doctor", "--quick", "--out", str(tmp_path), "--no-progress"])
    printed = capsys.readouterr().out.splitlines()
    steps = [line for line in printed if line.startswith("[")]
    assert [line.split("]")[0] + "]" for line in steps] == [f"[{i}/8]" for i in range(1, 9)]
    doc = json.loads((tmp_path / "report.json").read_text())
    status = {s["name"]: s["status"] for s in doc["steps"]}
    assert list(status) == list(runner.NAMES)
    for name in ("overlap", "races", "memory"):
        assert status[name] == SKIP
        line = next(s for s in steps if runner.STEPS[runner.NAMES.index(name)].title in s)
        assert "SKIP" in line and "no CUDA device" in line
    for name in ("environment", "correctness", "tutorial", "profile"):
        assert status[name] == PASS, doc["steps"][runner.NAMES.index(name)]
    # Step 6 times no "CUDA graph" on the CPU (it would run eagerly) and says why.
    tutorial = doc["steps"][runner.NAMES.index("tutorial")]
    assert bench.GRAPHED not in {m["model"] for m in tutorial["data"]["models"]}
    (graph,) = [c for c in tutorial["checks"] if bench.GRAPHED in c["name"]]
    assert graph["status"] == SKIP and "no CUDA graph on cpu" in graph["detail"]
    assert status["cost-model"] == PASS, doc["steps"][runner.NAMES.index("cost-model")]
    assert_cost_model_checks(doc["steps"][runner.NAMES.index("cost-model")])
    assert code == 0
    assert printed[-1] == f"overall: {PASS}"  # table last
    assert any(line.startswith(f"report in {tmp_path}: summary.md") for line in printed)
    assert doc["environment"]["torch"] == torch.__version__ and doc["sizes"] == "quick"
    assert doc["command"].startswith("mpstream doctor --quick")
    # At most 8 files, no folders; the figures and the archive are there.
    names = sorted(p.name for p in tmp_path.iterdir())
    assert all((tmp_path / n).is_file() for n in names) and len(names) <= report.MAX_FILES
    assert names == sorted(doc["files"])
    assert "overlap.png" not in names  # the stale one is gone, nothing replaced it on a CPU
    for png in ("timeline.png", "mp_vs_rn.png", "mp_vs_rn_vs_pp.png", "split_size_tradeoff.png"):
        assert (tmp_path / png).read_bytes().startswith(b"\x89PNG")
    with tarfile.open(tmp_path / report.ARCHIVE) as tar:
        archived = set(tar.getnames())
    assert {"trace.json", "results.json", "doctor.log"} <= archived
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# mpstream doctor: ") and "**Device:** no GPU" in summary
    for step in runner.STEPS:
        assert f"| {step.title} |" in summary
    # The same profiles against a limit no error meets: every split size
    # fails, and the step says what the model leaves out.
    (context,) = contexts
    monkeypatch.setattr(modelcheck, "MAX_ERROR", -1.0)
    failed = modelcheck.run(context)
    assert failed.status == FAIL
    assert [c.status for c in failed.checks if c.name.startswith("cost model at split")] == [
        FAIL,
        FAIL,
    ]
    assert failed.reason.startswith("off by ")
    assert "the model does not include host issue time" in failed.reason


def assert_cost_model_checks(step: dict[str, Any]) -> None:
    """Step 8 on the CPU: each profiled split size simulated against its
    measured step (the error is their relative difference), and predictions
    for 2 and 4 GPUs with a balance over every layer, which decide nothing."""
    splits = list(TINY.experiment.split_sizes)
    rows = step["data"]["validation"]
    assert [r["split_size"] for r in rows] == splits and step["data"]["fitted_at_split"] == 2
    assert [r["micro_batches"] for r in rows] == [
        -(-TINY.experiment.batch_size // s) for s in splits
    ]
    for row in rows:
        assert row["measured_ms"] > 0 and row["predicted_ms"] > 0
        assert row["error"] == pytest.approx(row["predicted_ms"] / row["measured_ms"] - 1)
        assert not row["issue_modelled"]  # the CPU's issue time is the compute itself
    checks = step["checks"]
    validation = [c for c in checks if c["name"].startswith("cost model at split")]
    assert [(c["name"], c["status"]) for c in validation] == [
        (f"cost model at split {s}", PASS) for s in splits
    ]
    assert [c["error"] for c in validation] == [r["error"] for r in rows]
    predictions = step["data"]["predictions"]
    assert [p["gpus"] for p in predictions] == [2, 4]
    layers = len(step["data"]["layer_ms_calibrated"])
    for p in predictions:
        assert len(p["balance"]) == p["gpus"] and sum(p["balance"]) == layers
        assert p["predicted_step_ms"] > 0 and p["predicted_speedup"] > 0
    told = [c for c in checks if c["name"].startswith("prediction (not measured)")]
    assert [c["name"] for c in told] == [
        f"prediction (not measured): {p['gpus']} GPUs, automatic balance {p['balance']}"
        for p in predictions
    ]
    assert all(c["status"] == "INFO" for c in told)  # no verdict
    # A CPU run's predictions come from the CPU's costs, and say so.
    assert all("measured on this CPU, not on a GPU" in c["detail"] for c in told)
    assert "; predicted from the CPU's costs 2 GPUs" in step["figure"]


def ctx(tmp_path: Path) -> Context:
    cpu = torch.device("cpu")
    return Context((cpu, cpu), TINY, "resnet50", tmp_path, tmp_path)


def test_a_failing_step_does_not_stop_the_run_and_keeps_its_traceback(tmp_path: Path) -> None:
    def broken(_: Context) -> StepResult:
        raise RuntimeError("boom\nsecond line")

    step = runner.Step("broken", "Broken", broken)
    result = runner.run_step(step, ctx(tmp_path), ())
    assert result.status == FAIL and result.reason == "RuntimeError: boom"
    assert "RuntimeError: boom" in (tmp_path / "broken.traceback.txt").read_text()


def test_skips_for_the_option_for_cuda_and_for_missing_inputs(tmp_path: Path) -> None:
    def never(_: Context) -> StepResult:
        raise AssertionError("must not run")

    c = ctx(tmp_path)
    skipped = runner.run_step(runner.Step("a", "A", never), c, ("a",))
    assert (skipped.status, skipped.reason) == (SKIP, "skipped with --skip")
    gpu = runner.run_step(runner.Step("overlap", "Overlap", never, needs_cuda=True), c, ())
    assert gpu.status == SKIP and gpu.reason.startswith("no CUDA device (cpu, cpu)")
    needs = runner.run_step(runner.Step("x", "X", never, needs=("profiles",)), c, ())
    assert needs.status == SKIP and "step 7" in needs.reason


def test_a_run_stopped_part_way_leaves_the_report_of_the_steps_that_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def passes(_: Context) -> StepResult:
        return StepResult("a", "A", PASS, figure="42")

    def stopped(_: Context) -> StepResult:
        raise KeyboardInterrupt  # a stop part-way (a time limit's SIGTERM leaves no time at all)

    steps = (runner.Step("a", "A", passes), runner.Step("b", "B", stopped))
    monkeypatch.setattr(runner, "STEPS", steps)
    with pytest.raises(KeyboardInterrupt):
        runner.run(runner.Options(tmp_path, devices="cpu", sizes=TINY), echo=lambda _: None)
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# mpstream doctor: PASS so far")
    assert "**Partial:** written after step 1 of 2" in summary and "| 42 |" in summary
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["partial"].startswith("written after step 1 of 2") and len(doc["steps"]) == 1
    monkeypatch.setattr(runner, "STEPS", steps[:1] * 2)
    runner.run(runner.Options(tmp_path, devices="cpu", sizes=TINY), echo=lambda _: None)
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["partial"] is None and len(doc["steps"]) == 2
    assert "Partial" not in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--skip", "bogus"], "invalid choice"), (["--model", "resnet152"], "invalid choice")],
)
def test_bad_doctor_options(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["doctor", *args])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_bad_devices_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--devices", "tpu:0", "--out", str(tmp_path)]) == 2
    assert "not a device name" in capsys.readouterr().err


def results() -> list[StepResult]:
    return [
        StepResult("a", "Alpha", PASS, "3/3 | fine", checks=[Check("x | y", PASS, "ok")]),
        StepResult("b", "Beta", FAIL, "fig", "it broke", checks=[Check("z", FAIL, "bad")]),
        StepResult("c", "Gamma", SKIP, reason="no CUDA device"),
    ]


def test_table_and_markdown() -> None:
    rs = results()
    text = report.table(rs)
    assert text.splitlines()[2].split()[:3] == ["1", "Alpha", "PASS"]
    assert "it broke" in text and text.endswith("overall: FAIL")
    meta = {
        "environment": {"gpus": [], "cpu": "some CPU", "torch": "2.x"},
        "command": "mpstream doctor",
        "devices": ["cpu", "cpu"],
        "sizes": "quick",
        "created": "now",
        "total_seconds": 1.0,
        "archived": ["trace.json"],
    }
    md = report.markdown(rs, meta, ["summary.md", "timeline.png"])
    assert md.startswith("# mpstream doctor: FAIL")
    assert "| 1 | Alpha | **PASS** | 3/3 \\| fine |" in md  # cells escape the pipe
    assert "| x \\| y | PASS | ok |" in md and "![timeline](timeline.png)" in md
    assert report.status_of(rs[:1]) == PASS
    assert report.status_of([rs[0], rs[2]]) == PASS
    assert report.status_of(rs[2:]) == SKIP  # nothing was checked


def test_write_archives_the_scratch_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    out.mkdir()
    scratch.mkdir()
    (scratch / "trace.json").write_text("{}")
    (out / "timeline.png").write_bytes(b"png")
    meta = {
        "environment": {"gpus": []},
        "command": "c",
        "devices": ["cpu"],
        "sizes": "quick",
        "created": "now",
        "total_seconds": 0.0,
    }
    written = report.write(out, scratch, results(), meta)
    assert [p.name for p in written] == [
        "summary.md",
        "report.json",
        "timeline.png",
        report.ARCHIVE,
    ]
    doc = json.loads((out / "report.json").read_text())
    assert doc["status"] == FAIL and doc["archived"] == ["trace.json"]
    assert [s["status"] for s in doc["steps"]] == [PASS, FAIL, SKIP]
    # A write that fails part-way keeps the last whole file, and no partial one.
    before = (out / "summary.md").read_text()

    def broken(*_: Any) -> str:
        raise OSError("disk full")

    monkeypatch.setattr(report, "markdown", broken)
    with pytest.raises(OSError, match="disk full"):
        report.write(out, scratch, results(), meta)
    assert (out / "summary.md").read_text() == before
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in written)


def test_the_workload_options_size_the_experiment() -> None:
    options = runner.Options(Path("x"), image_size=(224, 160), batch_size=8, split_sizes=(4, 2))
    config = runner.sized(TINY, options).experiment
    assert (config.image_w, config.image_h, config.batch_size) == (224, 160, 8)
    # The first is the main one; the sweep runs in increasing order.
    assert (config.split_size, config.split_sizes) == (4, (2, 4))
    # Without split sizes, the standard ones that fit the batch.
    config = runner.sized(TINY, runner.Options(Path("x"), batch_size=3)).experiment
    assert (config.split_size, config.split_sizes) == (2, (2,))
    assert runner.sized(TINY, runner.Options(Path("x"))) == TINY


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--image-size", "16x64"], "--image-size 16x64: must be at least 32x32"),
        (["--batch-size", "4", "--split-sizes", "2,8"], "--split-sizes 8: larger than the batch"),
        (["--batch-size", "1"], "--batch-size 1 is below every split size"),
        (
            ["--split-sizes", "2", "--skip", "tutorial", "profile", "cost-model"],
            "--split-sizes: size steps 6-8 (tutorial, profile, cost-model), which --skip skips",
        ),
    ],
)
def test_bad_workload_options_exit_2(
    args: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(runner, "QUICK", TINY)
    assert cli.main(["doctor", "--quick", "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()  # refused before any step ran


def test_the_report_records_the_workload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def passes(_: Context) -> StepResult:
        return StepResult("tutorial", "Tutorial experiment", PASS)

    monkeypatch.setattr(runner, "QUICK", TINY)
    # One step the workload sizes, standing in for the real ones (a workload
    # whose steps are all skipped is refused).
    monkeypatch.setattr(runner, "STEPS", (runner.Step("tutorial", "Tutorial experiment", passes),))
    argv = ["doctor", "--quick", "--out", str(tmp_path), "--no-progress"]
    assert cli.main([*argv, "--image-size", "64", "--batch-size", "6", "--split-sizes", "3"]) == 0
    assert "(experiment: 64x64 images, batch 6, split sizes 3)" in capsys.readouterr().out
    experiment = json.loads((tmp_path / "report.json").read_text())["size_values"]["experiment"]
    assert (experiment["image_w"], experiment["batch_size"], experiment["split_sizes"]) == (
        64,
        6,
        [3],
    )


def test_check_refuses_bad_options_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="--preset sizes the transformer"):
        runner.check(runner.Options(out, preset="tiny"))
    devices, sizes, label, preset = runner.check(runner.Options(out, devices="cpu", sizes=TINY))
    assert [str(d) for d in devices] == ["cpu", "cpu"] and sizes == TINY
    assert (label, preset) == ("custom", "tiny")
    assert not out.exists()  # checking runs nothing

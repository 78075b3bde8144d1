"""``mpstream bench``: the CLI, the JSON, the figures and option errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import mpstream
from mpstream import cli
from mpstream.observe import figures
from mpstream.observe.figures import tutorial_figures
from mpstream.tutorial import bench, design, machine, report

TINY = [
    "--quick",
    "--repeat",
    "2",
    "--warmup",
    "0",
    "--batch-size",
    "4",
    "--image-size",
    "32",
    "--num-batches",
    "1",
    "--split-size",
    "2",
    "--split-sizes",
    "2,4",
    "--num-classes",
    "10",
    "--no-progress",
    "--devices",  # the CPU even where a GPU exists: these tests check the CPU path
    "cpu,cpu",
]


def test_bench_writes_json_and_the_three_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", *TINY, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    cpu = torch.device("cpu")
    measured = list(bench.models_for(cpu, cpu))  # no CUDA graph on the CPU
    assert measured == ["single device", "model parallel", "tutorial pipeline", "mpstream"]
    for name in measured:
        assert name in printed
    assert "speed-up" in printed and "split-size sweep" in printed
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["torch"] == torch.__version__
    assert doc["mpstream"] == mpstream.__version__
    assert doc["devices"] == ["cpu", "cpu"] and len(doc["device_names"]) == 2
    assert "git_commit" in doc and doc["config"]["batch_size"] == 4
    assert [m["model"] for m in doc["models"]] == measured
    for m in doc["models"]:
        assert len(m["times_s"]) == 2 and m["mean_s"] > 0 and m["speedup_vs_single"] > 0
    sweep = {(m["model"], m["split_size"]) for m in doc["split_sweep"]}
    assert sweep == {(p, s) for p in bench.PIPELINES for s in (2, 4)}
    for graphed in design.GRAPHS:
        assert f"{graphed}: not measured, no CUDA graph on cpu" in printed
    assert set(doc["not_measured"]) == set(design.GRAPHS)
    for png in ("mp_vs_rn.png", "mp_vs_rn_vs_pp.png", "split_size_tradeoff.png"):
        data = (tmp_path / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000


def test_bench_without_sweep_or_plots(tmp_path: Path) -> None:
    # The sweep's sizes are refused beside --no-sweep.
    at = TINY.index("--split-sizes")
    tiny = TINY[:at] + TINY[at + 2 :]
    args = ["bench", *tiny, "--no-sweep", "--no-plots", "--out", str(tmp_path)]
    (tmp_path / "mp_vs_rn.png").write_bytes(b"an earlier run's")
    assert cli.main(args) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # none stale
    assert json.loads((tmp_path / "results.json").read_text())["split_sweep"] == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--repeat", "0"], "must be at least 1"),
        (["--repeat", "two"], "expected a whole number"),
        (["--split-sizes", "1,x"], "expected a whole number"),
        (["--split-sizes", ","], "comma-separated sizes"),
        (["--image-size", "64x64x3"], "expected W or WxH"),
        (["--warmup", "-1"], "must not be negative"),
    ],
)
def test_bad_options_are_argparse_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--devices", "cpu,cpu,cpu"], "one or two comma-separated devices"),
        (["--devices", "cpu,tpu:0"], "not a device name"),
        (["--devices", "cpu,meta"], "not a cpu or cuda device"),
        (["--image-size", "16"], "at least 32x32"),
        (["--split-size", "8"], "--split-size 8: larger than the batch of 4 images"),
        (["--split-sizes", "2,6"], "--split-sizes 6: larger than the batch of 4 images"),
    ],
)
def test_bad_values_exit_2_with_a_message(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", *TINY, *args, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_devices_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--devices", "cuda:0,cuda:1"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_detect_devices_defaults() -> None:
    dev0, dev1 = bench.detect_devices()
    if torch.cuda.is_available():
        assert dev0 == torch.device("cuda", 0)
    else:
        assert (dev0, dev1) == (torch.device("cpu"), torch.device("cpu"))
    assert bench.detect_devices(" cpu , cpu ") == (torch.device("cpu"), torch.device("cpu"))


def test_one_device_serves_both_halves(capsys: pytest.CaptureFixture[str]) -> None:
    cpu = torch.device("cpu")
    assert bench.detect_devices("cpu") == (cpu, cpu)
    assert bench.detect_devices(" cpu ,") == (cpu, cpu)
    with pytest.raises(ValueError, match="takes one or two comma-separated devices"):
        bench.detect_devices("cpu,cpu,cpu")
    assert cli.main(["bench", "--devices", "cpu,cpu,cpu"]) == 2  # the bench and the doctor alike
    assert "takes one or two comma-separated devices, got 'cpu,cpu,cpu'" in capsys.readouterr().err


def test_calls_counts_every_train_call() -> None:
    config = bench.QUICK
    distinct = len(set(config.split_sizes) | {config.split_size})
    per = config.warmup + config.repeat
    # Every model; four of them (two pipelines and two graphed ones) swept.
    assert bench.calls(config, sweep=True) == per * (3 + 4 * distinct)
    assert bench.calls(config, sweep=False) == per * 7
    two = bench.models_for(torch.device("cuda:0"), torch.device("cuda:1"))
    assert bench.GRAPHED not in two  # a whole captured step cannot span devices
    assert bench.STAGE_GRAPHS in two and bench.SINGLE_GRAPHED in two  # graphs per stage can
    assert bench.calls(config, sweep=False, models=two) == per * 6
    assert bench.calls(config, sweep=True, models=two) == per * (3 + 3 * distinct)
    assert bench.models_for(torch.device("cuda:0"), torch.device("cuda:0")) == bench.MODELS
    assert bench.GRAPHED in bench.swept(bench.MODELS)  # one GPU: the graph is swept too
    assert bench.STAGE_GRAPHS in bench.swept(bench.MODELS)
    if torch.cuda.is_available():  # "cuda" is the current device, the same one
        current = torch.device("cuda", torch.cuda.current_device())
        assert bench.models_for(torch.device("cuda"), current) == bench.MODELS


def test_the_cuda_graph_is_left_out_and_said_so_on_the_cpu() -> None:
    # Timed eagerly it would read as a slow "CUDA graph": graphs would seem to hurt.
    cpu, gpu = torch.device("cpu"), torch.device("cuda:0")
    for graphed in design.GRAPHS:
        assert graphed not in bench.models_for(cpu, cpu)
        why = bench.left_out(cpu, cpu)[graphed]
        assert why == "no CUDA graph on cpu: its step would only run eagerly"
    # Graphed stages need each half on a GPU, not both on one.
    assert set(bench.left_out(gpu, cpu)) == {bench.STAGE_GRAPHS, bench.GRAPHED}
    assert bench.left_out(gpu, gpu) == {}
    assert "cannot span two devices" in bench.left_out(gpu, torch.device("cuda:1"))[bench.GRAPHED]
    # The table says why it is missing.
    cfg = bench.Config(split_size=2, split_sizes=())
    models = [design.Measurement(n, None, [1.0]) for n in bench.models_for(cpu, cpu)]
    printed = bench.table(design.Results(cfg, (cpu, cpu), models, []))
    assert printed.count(bench.GRAPHED) == 1
    assert f"{bench.GRAPHED}: not measured, no CUDA graph on cpu" in printed


def test_figures_from_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = bench.Config(split_size=2, split_sizes=(1, 2))
    cpu = torch.device("cpu")
    models = [
        design.Measurement(n, 2 if n in bench.swept(bench.MODELS) else None, [1.0, 1.2])
        for n in bench.MODELS
    ]
    names = bench.swept(bench.MODELS)
    sweep = [design.Measurement(p, s, [0.5 * s, 0.6 * s]) for p in names for s in (1, 2)]
    labels: dict[str, tuple[str, str]] = {}
    draw = figures.save

    def save(fig: Any, ax: Any, path: Path, title: str = "", **kw: Any) -> Path:
        labels[path.name] = (ax.get_xlabel(), ax.get_ylabel())
        return draw(fig, ax, path, title, **kw)

    monkeypatch.setattr(figures, "save", save)
    paths = tutorial_figures(design.Results(cfg, (cpu, cpu), models, sweep), tmp_path)
    assert [p.name for p in paths] == [
        "mp_vs_rn.png",
        "mp_vs_rn_vs_pp.png",
        "split_size_tradeoff.png",
    ]
    # Every axis is labelled, and the y axis says what the error bars are.
    spread = "mean; bars: fastest to slowest of 10 train() calls"  # Config().repeat calls
    for xlabel, ylabel in labels.values():
        assert xlabel and ylabel == f"ResNet50 execution time (s)\n{spread}"


def test_python_dash_m_entry_point() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mpstream", "--version"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    assert result.stdout.strip() == f"mpstream {mpstream.__version__}"


def test_commit_comes_from_the_environment_without_git(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_git(*args: object, **kwargs: object) -> None:
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    monkeypatch.delenv("MPSTREAM_COMMIT", raising=False)
    assert bench.git_commit() is None
    monkeypatch.setenv("MPSTREAM_COMMIT", "f3db5e8")
    assert bench.git_commit() == "f3db5e8"


def test_an_explicit_commit_wins_over_git(monkeypatch: pytest.MonkeyPatch) -> None:
    # On the GPU machine a .git from an older snapshot travelled with the
    # tree and named the wrong commit.
    monkeypatch.setenv("MPSTREAM_COMMIT", "81f9503")
    assert bench.git_commit() == "81f9503"
    monkeypatch.delenv("MPSTREAM_COMMIT")
    assert bench.git_commit() not in (None, "81f9503")  # this checkout's own


def test_a_graphed_model_is_compared_with_the_single_device_captured_the_same_way() -> None:
    from mpstream.tutorial.design import GRAPHED, SINGLE_GRAPHED, Measurement, Results

    cpu = torch.device("cpu")
    models = [
        Measurement("single device", None, [0.248]),
        Measurement("mpstream", 12, [0.25]),
        Measurement(SINGLE_GRAPHED, None, [0.150]),
        Measurement(GRAPHED, 12, [0.205]),
    ]
    results = Results(bench.QUICK, (cpu, cpu), models, [])
    rows = {m["model"]: m for m in report.to_json(results)["models"]}
    assert rows[GRAPHED]["baseline"] == SINGLE_GRAPHED
    assert rows[GRAPHED]["speedup_vs_baseline"] == pytest.approx(0.150 / 0.205)
    assert rows[GRAPHED]["speedup_vs_single"] == pytest.approx(0.248 / 0.205)
    assert rows["mpstream"]["baseline"] == "single device"
    line = next(x for x in bench.table(results).splitlines() if x.startswith(GRAPHED))
    assert line.endswith(f"0.73x  {SINGLE_GRAPHED}")
    # Without the captured single device, the eager one is the baseline.
    eager_only = Results(bench.QUICK, (cpu, cpu), models[:2] + models[3:], [])
    assert report.baseline(eager_only, GRAPHED) == "single device"


def test_an_interrupted_bench_prints_and_saves_what_it_timed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGTERM (timeout, a device lease's limit) in the first round: the
    # models timed so far are printed and saved; the figures, which need
    # them all, are not.
    import os
    import signal

    calls: list[int] = []
    train_once = bench.train_once

    def terminated(*args: Any) -> float:
        calls.append(1)
        if len(calls) == 3:  # the single device and model parallel timed, then the signal
            os.kill(os.getpid(), signal.SIGTERM)
        return train_once(*args)

    monkeypatch.setattr(bench, "train_once", terminated)
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["bench", *TINY, "--out", str(tmp_path)]) == 130
    assert signal.getsignal(signal.SIGTERM) is before
    out, err = capsys.readouterr()
    assert "interrupted: the results are partial" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["interrupted"] and doc["split_sweep"] == []
    assert [m["model"] for m in doc["models"]] == ["single device", "model parallel"]
    assert all(m["speedup_vs_single"] > 0 and len(m["times_s"]) == 1 for m in doc["models"])
    untimed = [f"{p} (split {s})" for s in (2, 4) for p in ("tutorial pipeline", "mpstream")]
    assert doc["not_timed"] == untimed
    said = (
        "interrupted: the figures above are what ran before it; figures not drawn; "
        "fewer than 2 rounds: single device, model parallel; not timed: tutorial pipeline"
    )
    assert said in out
    assert "split-size sweep" not in out  # none of it timed


def test_a_run_interrupted_before_its_baseline_has_no_ratios() -> None:
    cfg = bench.Config(split_size=2, split_sizes=(2, 4))
    cpu = torch.device("cpu")
    models = [design.Measurement("mpstream", 2, [0.2, 0.2])]
    not_timed = ["single device", "mpstream (split 4)"]
    results = design.Results(cfg, (cpu, cpu), models, models, {}, not_timed)
    doc = report.to_json(results)
    assert doc["models"][0]["speedup_vs_single"] is None
    assert doc["models"][0]["speedup_vs_baseline"] is None
    lines = report.table(results).splitlines()
    assert any(line.endswith("not timed: single device, mpstream (split 4)") for line in lines)
    assert "  split   4: " + " " * 15 + "- " in lines  # the sweep's row: a dash
    with pytest.raises(KeyError):  # get() is for what was timed
        results.get("single device")


def test_the_sweep_runs_in_increasing_order_under_its_models_names() -> None:
    cfg = bench.Config(split_size=2, split_sizes=(4, 1, 2, 4))
    assert cfg.split_sizes == (1, 2, 4)  # the API as the CLI: one point per size, in order
    names = bench.swept(bench.MODELS)
    sweep = [design.Measurement(p, s, [0.5 * s]) for p in names for s in cfg.split_sizes]
    cpu = torch.device("cpu")
    printed = bench.table(design.Results(cfg, (cpu, cpu), [], sweep)).splitlines()
    at = printed.index("split-size sweep, mean (s):")
    header, first = printed[at + 1], printed[at + 2]
    for name in names:  # each value right-aligned under its model's name
        end = header.index(name) + len(name)
        assert first[:end].rstrip().endswith("0.500") and first[end : end + 1] in ("", " ")


def test_a_run_on_devices_of_two_models_names_and_records_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    here = bench.device_name(cpu)
    assert machine.named_devices((cpu, gpu)) == f"cpu ({here}), cuda:0 (NVIDIA H100)"
    # Devices of one model name it once, as before.
    assert machine.named_devices(["cuda:0", "cuda:1"], ["H100"] * 2) == "cuda:0, cuda:1 (H100)"
    with pytest.raises(ValueError, match="2 devices but 1 name:"):
        machine.named_devices((cpu, gpu), [here])
    # results.json records both devices and both models.
    results = design.Results(bench.QUICK, (cpu, gpu), [], [])
    doc = report.to_json(results)
    assert doc["devices"] == ["cpu", "cuda:0"]
    assert doc["device_names"] == [here, "NVIDIA H100"]

"""``mpstream doctor --model transformer`` on the CPU: the ResNet steps'
checks on the transformer workload, its report and what it refuses."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mpstream.doctor import Options, run, transformer_checks, transformer_costs
from mpstream.doctor import transformer as steps_of
from mpstream.doctor.diagnosis import FAIL, PASS, TINY, Context
from mpstream.doctor.runner import TRANSFORMER_STEPS
from mpstream.workloads import bench, report, transformer


def test_the_transformer_doctor_runs_every_step_it_can_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cost model's error depends on timings on a shared CPU: with no
    # limit its verdict is known (PASS); step 8 runs again below with a limit
    # nothing meets (FAIL), on the context it ran with.
    monkeypatch.setattr(transformer_costs, "MAX_ERROR", math.inf)
    contexts: list[Context] = []
    preset_of = transformer_costs.preset_of

    def keep_context(ctx: Context) -> transformer.Preset:
        contexts.append(ctx)
        return preset_of(ctx)

    monkeypatch.setattr(transformer_costs, "preset_of", keep_context)
    lines: list[str] = []
    code = run(
        Options(out=tmp_path, arch="transformer", sizes=TINY, progress=False), echo=lines.append
    )
    assert code == 0, "\n".join(lines)
    assert "transformer tiny" in lines[0]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["arch"] == "transformer" and report["preset"] == "tiny"
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == [s.name for s in TRANSFORMER_STEPS]
    assert [steps[n]["status"] for n in ("overlap", "races")] == ["SKIP", "SKIP"]  # CUDA only
    # Every schedule x checkpoint mode x 2 micro-batch counts.
    assert steps["correctness"]["figure"].startswith("48/48 cases equal the unsplit model")
    assert "1f1b stage 0 activations" in steps["memory"]["figure"]
    assert "CPU: nothing overlaps" in steps["experiment"]["figure"]
    predictions = steps["cost-model"]["data"]["predictions"]
    assert [p["gpus"] for p in predictions] == [2, 4]  # 8 GPUs need 8 blocks
    assert all(p["per_device_bytes"] for p in predictions)
    details = [c["detail"] for c in steps["cost-model"]["checks"]]
    assert any("a GPU target, from the CPU's costs" in d for d in details)
    for name in ("transformer.json", "transformer_throughput.png", "transformer_memory.png",
                 "transformer_memory_schedules.png",
                 "transformer_timeline.png"):  # fmt: skip
        assert (tmp_path / name).exists(), name
    assert steps["cost-model"]["status"] == PASS
    monkeypatch.setattr(transformer_costs, "MAX_ERROR", 0.0)
    again = transformer_costs.cost_model(contexts[-1])
    assert again.status == FAIL and again.reason.startswith("cost model against the profiled step")


def test_a_correctness_case_that_raises_fails_that_case_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("stage 1 is broken\nmore")

    monkeypatch.setattr(transformer_checks, "Pipe", broken)
    p = transformer.preset("tiny")
    ref = transformer.decoder(p).double()
    x, y = transformer.tokens(p)
    loss = transformer.loss_fn(ref(x), y)
    options = {"schedule": "1f1b", "checkpoint": "never", "chunks": 2}
    cpu = torch.device("cpu")
    check = transformer_checks._case("1f1b", options, ref, x, y, loss, {}, (cpu, cpu))
    assert (check.status, check.detail) == (FAIL, "RuntimeError: stage 1 is broken")


def test_what_the_transformer_doctor_refuses(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--preset sizes the transformer"):
        run(Options(out=tmp_path, preset="tiny", sizes=TINY))
    with pytest.raises(ValueError, match="--batch-size: the tutorial's experiment's"):
        run(Options(out=tmp_path, arch="transformer", batch_size=8, sizes=TINY))
    with pytest.raises(ValueError, match="unknown step.*tutorial for transformer"):
        run(Options(out=tmp_path, arch="transformer", skip=("tutorial",), sizes=TINY))
    with pytest.raises(ValueError, match="unknown transformer preset 'huge'"):
        run(Options(out=tmp_path, arch="transformer", preset="huge", sizes=TINY))


def test_graphed_stages_that_ran_eagerly_fail_the_experiment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A capture that failed for another reason than memory: the bench keeps
    # its times (beside everything else's), the doctor names the defect.
    cpu = torch.device("cpu")
    p = transformer.preset("tiny", micro_batches=(2,))
    graphed = (bench.GRAPHED, "1f1b", 2)
    why = "stage 0 runs eagerly (operation not permitted when stream is capturing)"

    def fake_run(config: bench.Config, **_: object) -> bench.Results:
        keys = [*bench.keys_for(config), graphed]
        measured = {k: bench.Measured(k, [0.1, 0.1], [0.01]) for k in keys}
        measured[graphed].eager = why
        return bench.Results(config, measured, {"load": {}})

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(report, "save", lambda results, out: [])
    ctx = Context((cpu, cpu), TINY, "transformer", tmp_path, tmp_path, False)
    ctx.shared["preset"] = "tiny"
    monkeypatch.setattr(steps_of, "preset_of", lambda ctx: p)
    monkeypatch.setattr(transformer, "preset", lambda name, **kw: p)
    result = steps_of.experiment(ctx)
    assert result.status == FAIL and why in result.reason
    assert bench.label(graphed) in result.reason


def test_a_single_device_that_cannot_hold_the_model_is_said_not_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 3b on one H200: the model only a pipeline holds is the workload's point.
    cpu = torch.device("cpu")
    p = transformer.preset("tiny", micro_batches=(2,))
    single = (bench.SINGLE, None, None)
    why = "does not fit in device memory even alone (CUDA out of memory. Tried to allocate)"

    def fake_run(config: bench.Config, **_: object) -> bench.Results:
        keys = [k for k in bench.keys_for(config) if k != single]
        measured = {k: bench.Measured(k, [0.1, 0.1], [0.01]) for k in keys}
        return bench.Results(config, measured, {"load": {}}, {single: why})

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(report, "save", lambda results, out: [])
    ctx = Context((cpu, cpu), TINY, "transformer", tmp_path, tmp_path, False)
    monkeypatch.setattr(steps_of, "preset_of", lambda ctx: p)
    monkeypatch.setattr(transformer, "preset", lambda name, **kw: p)
    result = steps_of.experiment(ctx)
    assert result.status == PASS, result
    assert "the single device could not hold the model" in result.figure
    assert "1.00x naive model parallel's" in result.figure
    assert any(c.name == bench.label(single) and c.detail == why for c in result.checks)


def test_graphed_stages_are_judged_against_the_captured_single_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = torch.device("cpu")
    p = transformer.preset("tiny", micro_batches=(2,))
    captured, graphed = (bench.CAPTURED, None, None), (bench.GRAPHED, "1f1b", 2)
    steps = {captured: 0.2, graphed: 0.21}

    def fake_run(config: bench.Config, **_: object) -> bench.Results:
        keys = [*bench.keys_for(config), captured, graphed]
        measured = {k: bench.Measured(k, [steps.get(k, 0.4)] * 2, [0.01]) for k in keys}
        return bench.Results(config, measured, {"load": {}})

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(report, "save", lambda results, out: [])
    ctx = Context((cpu, cpu), TINY, "transformer", tmp_path, tmp_path, False)
    monkeypatch.setattr(steps_of, "preset_of", lambda ctx: p)
    monkeypatch.setattr(transformer, "preset", lambda name, **kw: p)
    result = steps_of.experiment(ctx)
    assert result.status == PASS, result
    by_name = {c.name: c.detail for c in result.checks}
    headline = by_name["graphed stages at 2 micro-batches against the captured single device"]
    assert headline.startswith("1.05x its step (target <= 1.1x on one GPU: a GPU target)")
    assert "1.05x the captured single device's" in by_name[bench.label(graphed)]
    assert "1.00x the single device's" in by_name[bench.label(("mpstream", "1f1b", 2))]


def test_the_report_lists_the_transformer_files_and_a_rerun_removes_them(tmp_path: Path) -> None:
    from mpstream.doctor import report as report_files

    names = ["transformer.json", "transformer_timeline.png", "transformer_memory_schedules.png"]
    for name in names:
        (tmp_path / name).write_bytes(b"an earlier run's")
    listed = report_files.top_files(tmp_path)
    assert all(name in listed for name in names) and len(listed) <= report_files.MAX_FILES
    assert set(names) <= set(report_files.ARTIFACTS)  # what a run removes first


def test_1f1b_must_hold_fewer_activations_when_micro_batches_outnumber_stages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Equal activations at 4 micro-batches on 2 stages: 1F1B bounded nothing.
    from mpstream.observe import figures
    from mpstream.workloads import memory

    stage = {"parameters": 1, "gradients": 1, "optimizer": 2, "activations": 2**20}
    monkeypatch.setattr(memory, "per_stage", lambda *a, **k: ([stage, stage], {}))
    monkeypatch.setattr(figures, "memory_bars", lambda *a, **k: None)
    cpu = torch.device("cpu")
    ctx = Context((cpu, cpu), TINY, "transformer", tmp_path, tmp_path, False)
    ctx.shared["preset"] = "tiny"  # 4 micro-batches at most
    result = steps_of.memory_step(ctx)
    assert result.status == FAIL
    assert result.reason.startswith("1F1B holds fewer activations than gpipe on the first stage")
    # No more micro-batches than stages: both hold them all, equal is right.
    same = steps_of.activation_bound(2**20, 2**20, micro_batches=2, stages=2)
    assert same.status == PASS and "no more activations" in same.name
    assert steps_of.activation_bound(1, 2, micro_batches=4, stages=2).status == PASS

"""The pass/fail logic of each doctor step, without a GPU."""

from __future__ import annotations

import dataclasses
import functools
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from mpstream import tutorial
from mpstream.doctor import (
    attribution,
    checks,
    environment,
    experiment,
    modelcheck,
    overlap,
    probes,
    sanitizer,
    soak,
)
from mpstream.doctor.diagnosis import FAIL, PASS, SKIP, TINY, Check, Context, jsonable, overall
from mpstream.observe.cost_model import Costs, simulate
from mpstream.observe.timeline import Span, Timeline
from mpstream.runtime.plan import PlanError
from mpstream.schedules.schedule import SCHEDULES
from mpstream.tutorial.bench import Measurement, Results

CPU = torch.device("cpu")


def two_stage_timeline(overlapped: bool, runs: int = 2, micros: int = 4) -> Timeline:
    """Two stages of 1 ms per micro-batch, pipelined or one after the other."""
    spans = []
    for run in range(1, runs + 1):
        for m in range(micros):
            first = m if overlapped else 2 * m
            second = m + 1 if overlapped else 2 * m + 1
            spans.append(Span(0, m, "forward", "s0", float(first), first + 1.0, run))
            spans.append(Span(1, m, "forward", "s1", float(second), second + 1.0, run))
    return Timeline(spans, {"s0": "cuda:0", "s1": "cuda:0"})


def test_overlap_probe_fed_a_serial_timeline_fails() -> None:
    ideal = simulate([1.0, 1.0], 0.0, 4).step_ms
    result = overlap.timeline_overlap("serial", two_stage_timeline(False), ideal)
    assert (result.measured_ms, result.serial_ms, ideal) == (8.0, 8.0, 5.0)
    assert result.fraction == 0.0 and result.check().status == FAIL


def test_overlap_probe_fed_a_pipelined_timeline_passes() -> None:
    ideal = simulate([1.0, 1.0], 0.0, 4).step_ms
    check = overlap.timeline_overlap("pipelined", two_stage_timeline(True), ideal).check()
    assert check.status == PASS and check.data["fraction"] == 1.0 and "meets 0.9" in check.detail


@pytest.mark.parametrize(
    ("measured", "status", "words"),
    [
        (11.0, PASS, "below 0.9"),  # fraction 0.8: above the floor, under the target
        (12.5, FAIL, "below 0.9"),  # 0.5: what copies blocking compute would score
        (8.0, FAIL, "calibration off"),  # faster than the ideal
    ],
)
def test_overlap_thresholds(measured: float, status: str, words: str) -> None:
    check = overlap.Overlap("p", measured, serial_ms=15.0, ideal_ms=10.0).check()
    assert check.status == status and words in check.detail


def test_overlap_without_a_gap_fails_and_blocked_fraction() -> None:
    assert overlap.Overlap("p", 1.0, 1.0, 1.0).check().status == FAIL
    assert overlap.Overlap("p", 10.0, 15.0, 10.0, blocked_ms=12.5).blocked_fraction == 0.5


def test_size_copy_matches_the_stage_or_shrinks_it() -> None:
    assert overlap.size_copy(1e6, 2.0, 10**8) == (2_000_000, 2.0)  # a copy as long as a stage
    size, stage = overlap.size_copy(1e9, 2.0, 2**28)  # capped: stages shrink to the copy
    assert size == 2**28 and stage == pytest.approx(2**28 / 1e9)
    assert overlap.size_copy(1e12, 2.0, 2**20)[1] == overlap.MIN_STAGE_MS
    with pytest.raises(ValueError):
        overlap.size_copy(0.0, 1.0, 1)


def test_probes_run_on_the_cpu_where_nothing_overlaps() -> None:
    results = probes.compute_probes(CPU, 1.0, 2, 1) + probes.copy_probes(CPU, CPU, 1.0, 1, 2**16)
    assert len(results) == 5
    for r in results:
        assert r.check().status == FAIL, r  # host sleeps run one after the other


def test_busy_stage_spins_forward_and_backward() -> None:
    calls = []
    stage = probes.Busy(lambda: calls.append(1), width=3)
    out = stage(torch.zeros(2, 1))
    assert out.shape == (2, 3) and calls == [1]
    out.sum().backward()
    assert calls == [1, 1] and stage.weight.grad is not None


def test_csan_verdicts() -> None:
    done = sanitizer.DONE
    assert sanitizer.judge_csan(0, done, "")[0] == PASS
    report = f"{sanitizer.CSAN_MARK} on stream 7\nkernel a\n{sanitizer.CSAN_MARK} again\n"
    status, detail, races = sanitizer.judge_csan(1, done, report)
    assert (status, races) == (FAIL, 2) and "2 race report(s)" in detail
    assert sanitizer.judge_csan(1, done, "Traceback\nRuntimeError: x")[0] == FAIL
    assert sanitizer.judge_csan(0, "", "")[0] == FAIL  # the workload did not finish


def test_memcheck_verdicts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ok = f"{sanitizer.DONE}\n========= ERROR SUMMARY: 0 errors\n"
    assert sanitizer.judge_memcheck(0, ok) == (PASS, "ERROR SUMMARY: 0 errors", 0)
    bad = "========= Invalid __global__ read\n========= ERROR SUMMARY: 3 errors\n"
    assert sanitizer.judge_memcheck(1, bad)[::2] == (FAIL, 3)
    assert sanitizer.judge_memcheck(0, sanitizer.DONE)[0] == FAIL  # no summary: no verdict
    monkeypatch.setattr(shutil, "which", lambda name: None)
    check = sanitizer.memcheck(["cuda:0"], 10, tmp_path / "m.log")
    assert check.status == SKIP and "not on the PATH" in check.detail


def test_sanitizer_workload_runs_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    sanitizer.workload([["cpu", "cpu"], ["cpu"] * 3], short=True)
    assert sanitizer.DONE in capsys.readouterr().out
    code = sanitizer.command([["cuda:0", "cuda:1"]], short=True)[2]
    assert "workload([['cuda:0', 'cuda:1']], short=True)" in code


def test_the_sanitizer_subprocess_runs_the_workload(tmp_path: Path) -> None:
    # Without TORCH_CUDA_SANITIZER, which needs CUDA: the command line, the
    # environment and the verdict, end to end.
    log = tmp_path / "csan.log"
    code, out, err = sanitizer._run(
        sanitizer.command([["cpu", "cpu"]], short=True), sanitizer._env(), 120, log
    )
    assert sanitizer.judge_csan(code if code is not None else -1, out, err)[0] == PASS, err
    assert log.read_text().startswith("$ ") and "exit code: 0" in log.read_text()


def test_memory_verdicts() -> None:
    assert soak.memory_verdict([1000] * 5)[0] == PASS
    assert soak.memory_verdict([1000, 1000 + soak.SLACK_BYTES])[0] == PASS
    status, detail = soak.memory_verdict([1000 + i * 50_000 for i in range(5)])
    assert status == FAIL and "+200000 B" in detail
    assert soak.memory_verdict([1])[0] == FAIL


def test_soak_matches_the_single_device_and_drift_is_caught() -> None:
    seen: list[torch.device] = []
    result = soak.soak((CPU, CPU), 4, 1, lambda d: seen.append(d) or 7)
    assert result["drift"] is None and result["series"] == {"cpu": [7, 7, 7]}
    model, ref = nn.Linear(2, 2), nn.Linear(2, 2)
    assert soak.drift([(1.0, 1.0)], model, ref) is not None  # different weights
    assert "losses" in (soak.drift([(1.0, 1.5)], model, model) or "")


def test_importing_mpstream_leaves_cuda_trace_hooks_off() -> None:
    # Importing torch.cuda._sanitizer registers CSAN's CUDA trace hooks for
    # the whole process (torch 2.11): every allocation then runs Python, and
    # an exception in flight is lost (SystemError from autograd on the GPU).
    code = (
        "import sys, mpstream, mpstream.cli, mpstream.doctor, mpstream.doctor.sanitizer; "
        "assert 'torch.cuda._sanitizer' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_csan_workarounds_skip_empty_tensors_and_restore() -> None:
    # In a subprocess: importing CSAN turns its hooks on for the process.
    code = """
import torch
from torch.cuda import _sanitizer
from torch.utils import checkpoint
from mpstream.doctor.sanitizer import csan_workarounds

seen = []
def record(self, value, *args, **kwargs):
    seen.append(value.numel())
_sanitizer.ArgumentHandler._handle_argument = record
with csan_workarounds():
    assert checkpoint._enable_checkpoint_early_stop is False
    args = _sanitizer.ArgumentHandler()
    args._handle_argument(torch.empty(0), False, False)  # no elements: skipped
    args._handle_argument(torch.ones(3), False, False)
assert seen == [3], seen
assert _sanitizer.ArgumentHandler._handle_argument is record
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_every_peak_memory_row_builds_with_both_stages_on_one_device(tmp_path: Path) -> None:
    # On one GPU both stages share a device: interleaved 1F1B needs
    # virtual_stages there, which the first GPU run found missing.
    ctx = Context((CPU, CPU), TINY, "resnet50", tmp_path, tmp_path)
    config = TINY.peak_config
    x = torch.randn(config.batch_size, 3, config.image_h, config.image_w)
    y = torch.randn(config.batch_size, config.num_classes)
    for schedule in SCHEDULES:
        pipe = soak.peak_pipe(ctx, schedule, "except_last")
        assert pipe.schedule == schedule
    pipe.train_step(x, y, nn.MSELoss())  # the last one built: zero-bubble, checkpointed


def test_host_bound_verdicts() -> None:
    bound = attribution.host_bound(95.0, 100.0, {"stage0.compute": 50.0, "stage1.compute": 40.0})
    assert bound["host_bound"] and bound["verdict"].startswith("the host thread is the bottleneck")
    assert (
        bound["busiest_stream"] == "stage0.compute"
        and "95.0 ms of the 100.0 ms" in bound["verdict"]
    )
    assert not attribution.host_bound(95.0, 100.0, {"s": 98.0})["host_bound"]  # device-bound
    assert not attribution.host_bound(20.0, 100.0, {"s": 50.0})["host_bound"]  # host ran ahead


def test_stream_busy_is_the_union_per_stream() -> None:
    spans = [
        Span(0, 0, "forward", "a", 0.0, 2.0, 1),
        Span(0, 1, "forward", "a", 1.0, 3.0, 1),
        Span(1, 0, "forward", "b", 0.0, 1.0, 1),
    ]
    assert Timeline(spans, {"a": "x", "b": "x", "c": "x"}).stream_busy() == {
        "a": 3.0,
        "b": 1.0,
    }


def test_cost_model_validation_scaling_and_calibration() -> None:
    costs = Costs([(1.0, 2.0), (1.0, 2.0)], [(0.0, 0.0)])
    assert modelcheck.scaled(costs, 2.0).stage_times == [(2.0, 4.0), (2.0, 4.0)]
    labels = ["a", "b"]
    # "Measured" timelines that are the model's own: the error must be zero.
    small = simulate([(1.0, 2.0), (1.0, 2.0)], 0.0, 4, backward=True, devices=labels).timeline
    large = simulate([(3.0, 5.0), (3.0, 5.0)], 0.0, 2, backward=True, devices=labels).timeline
    rows = modelcheck.validate({2: small, 4: large}, 2, 8, True, labels)
    assert [r["micro_batches"] for r in rows] == [4, 2]
    assert [r["error"] for r in rows] == [0.0, 0.0]
    assert rows[0]["scaled_error"] == 0.0 and rows[1]["scaled_error"] < 0  # 3 ms is not 2 x 1 ms
    # Two runs, the first slowed down by interference: costs and makespan both
    # come from the second.
    slow = simulate([(2.0, 4.0), (2.0, 4.0)], 0.0, 4, backward=True, devices=labels).timeline
    both = Timeline(
        [dataclasses.replace(sp, run=1) for sp in slow.spans]
        + [dataclasses.replace(sp, run=2) for sp in small.spans],
        small.stream_devices,
    )
    step, makespan = modelcheck.fastest(both)
    assert step.runs() == [2] and makespan == rows[0]["measured_ms"]
    assert modelcheck.validate({2: both}, 2, 8, True, labels)[0]["error"] == 0.0
    layers = [(1.0, 1.0), (1.0, 3.0), (2.0, 2.0)]
    calibrated = modelcheck.calibrate(layers, [2, 1], Costs([(4.0, 8.0), (1.0, 1.0)], []))
    assert calibrated == [(2.0, 2.0), (2.0, 6.0), (1.0, 1.0)]


def test_cost_model_validation_with_the_hosts_issue_time() -> None:
    labels = ["a", "b"]
    issue = {("forward", 0): 3.0, ("backward", 0): 3.0, ("forward", 1): 3.0, ("backward", 1): 3.0}
    # A host-bound "measured" step: the issue times ride on its spans.
    bound = simulate(
        [(1.0, 2.0)] * 2, 0.0, 4, backward=True, devices=labels, issue_times=issue
    ).timeline
    (row,) = modelcheck.validate({2: bound}, 2, 8, True, labels)
    assert row["issue_modelled"] and row["error"] == 0.0
    assert row["measured_ms"] == 48.0 and row["devices_only_ms"] == 30.0
    costs = Costs([(1.0, 2.0)] * 2, [], issue_times=issue)
    assert modelcheck.scaled(costs, 2.0).issue_times == issue  # kernels per task: as many
    assert modelcheck.spread_issue([2, 1], costs) == [(1.5, 1.5), (1.5, 1.5), (3.0, 3.0)]


def test_correctness_grid_layouts() -> None:
    # forward + 4 schedules, x 3 checkpoint modes
    assert len(checks.cases((CPU, CPU))) == 5 * 3
    one = (torch.device("cuda:0"), torch.device("cuda:0"))
    two = (torch.device("cuda:0"), torch.device("cuda:1"))
    assert len(checks.cases(one)) == 2 * 3 * 5 * 3  # plain and forced copies x 3 sources
    # interleaved 1F1B cannot run on cuda:0 | cuda:1 | cuda:1 (not round-robin)
    assert len(checks.cases(two)) == 2 * 3 * 5 * 3 + 3 * 4 * 3
    assert {c.source for c in checks.cases(one)} == {"pageable", "pinned", "device"}


def test_correctness_cases_pass_and_a_wrong_pipeline_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    grid = checks.cases((CPU, CPU))
    case = next(c for c in grid if c.mode == "1f1b" and c.checkpoint == "always")
    assert checks._attempt(functools.partial(checks.run_case, case)) is None
    real = checks.Pipe

    def off_by_a_bit(*args: object, **kwargs: object) -> nn.Module:
        pipe = real(*args, **kwargs)  # type: ignore[arg-type]
        with torch.no_grad():
            next(pipe.parameters()).add_(1e-3)
        return pipe

    monkeypatch.setattr(checks, "Pipe", off_by_a_bit)
    error = checks._attempt(functools.partial(checks.run_case, case))
    assert error is not None and "not close" in error
    summary = checks.summarize([(case, None), (case, error)])
    assert [c.status for c in summary] == [FAIL] and "1/2 equal" in summary[0].detail


def test_plan_checks_pass_and_catch_a_bad_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    assert {c.status for c in checks.plan_grid()} == {PASS}

    def reject(plan: object) -> None:
        raise PlanError("invalid plan:\n  forward(stage=1, micro=0) is not ordered after copy")

    monkeypatch.setattr(checks, "verify_plan", reject)
    bad = checks.plan_grid()
    assert {c.status for c in bad} == {FAIL} and "is not ordered" in bad[0].detail


def test_environment_on_this_machine(tmp_path: Path) -> None:
    result = environment.run(Context((CPU, CPU), TINY, "resnet50", tmp_path, tmp_path))
    assert result.status == PASS and result.data["torch"] == torch.__version__
    assert result.data["extension"]["ok"] and result.data["mpstream"]


def test_environment_fails_when_the_extension_does_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = {"ok": False, "error": "mpstream._C was built against a different torch."}
    monkeypatch.setattr(environment, "extension_build", lambda: broken)
    result = environment.run(Context((CPU, CPU), TINY, "resnet50", tmp_path, tmp_path))
    assert result.status == FAIL and "different torch" in result.checks[0].detail


def test_experiment_config_for_resnet101(tmp_path: Path) -> None:
    from mpstream.doctor.diagnosis import FULL

    ctx = Context((CPU, CPU), FULL, "resnet101", tmp_path, tmp_path)
    config = experiment.config_for(ctx)
    assert (config.arch, config.split_size, config.split_sizes) == ("resnet101", 8, (8, 12, 20))
    ctx.arch = "resnet50"
    assert experiment.config_for(ctx).split_sizes == (12, 20)


def test_ratios_against_mpstream() -> None:
    config = TINY.experiment
    models = [
        Measurement("single device", None, [2.0]),
        Measurement("model parallel", None, [4.0]),
        Measurement("tutorial pipeline", 2, [1.0]),
        Measurement("mpstream", 2, [0.5]),
    ]
    rel = experiment.ratios(Results(config, (CPU, CPU), models, []))
    assert rel == {"single device": 0.25, "model parallel": 0.125, "tutorial pipeline": 0.5}


def test_resnet101_variants_and_the_idris_loop() -> None:
    deep = tutorial.PipelineParallelResNet101("cpu", "cpu", num_classes=10)
    assert len(deep.layer3) == 23 and deep.split_size == tutorial.IDRIS_SPLIT_SIZE
    assert tutorial.block_pipe("resnet50", "cpu", "cpu", 4, 10).balance == [11, 12]
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 3))
    loader = tutorial.fake_loader(2, 4, 8, 8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = tutorial.train_from_loader(model, loader, opt, CPU)
    assert torch.isfinite(loss)


def test_idris_loop_times_the_loader_alone_and_on_the_cpu_no_pinned_variants() -> None:
    config = dataclasses.replace(TINY.experiment, num_batches=2)
    loop = experiment.idris(config, (CPU, CPU), repeat=1, workers=0)
    names = [m.model for m in loop]
    assert len(names) == experiment.idris_variants(False)
    assert experiment.RESIDENT in names and experiment.LOADER_ALONE in names
    assert experiment.PINNED not in names  # pinning needs CUDA
    assert all(len(m.times) == 1 and m.median > 0 for m in loop)


def test_overall_and_jsonable() -> None:
    assert overall([Check("a", PASS), Check("b", SKIP)]) == PASS
    assert overall([Check("a", PASS), Check("b", FAIL)]) == FAIL
    assert overall([Check("a", SKIP)]) == SKIP
    assert jsonable({"d": CPU, "p": Path("x"), "t": (1, 2)}) == {"d": "cpu", "p": "x", "t": [1, 2]}


def test_graphed_stages_are_profiled_and_predicted_where_a_profile_exists(tmp_path: Path) -> None:
    # On a GPU step 7 profiles the main split again with graphed stages and
    # step 8 fits it; here the same functions run on a CPU profile.
    ctx = Context((CPU, CPU), TINY, "resnet50", tmp_path, tmp_path)
    config = experiment.config_for(ctx)
    assert modelcheck.graphed_predictions(ctx, 1, [], 1.0, [], []) == {}  # no profile
    ctx.shared["graphed_profile"] = attribution.profile_step(ctx, config.split_size, graphs=True)
    layer = types.SimpleNamespace(output_bytes=1000, forward_ms=1.0, backward_ms=2.0)
    profiled = [layer] * 23
    checks: list[Check] = []
    out = modelcheck.graphed_predictions(ctx, 4, profiled, 10.0, ["cpu", "cpu"], checks)
    assert [(p["schedule"], p["gpus"]) for p in out["predictions"]] == [
        ("gpipe", 2),
        ("gpipe", 4),
        ("1f1b", 2),
        ("1f1b", 4),
    ]
    names = [c.name for c in checks]
    assert names[0] == "cost model, graphed stages (measured one-GPU step)"
    assert "target ±10%" in checks[0].detail
    assert names[1].startswith("prediction (not measured): 2 GPUs, graphed stages, gpipe")
    assert names[3].startswith("prediction (not measured): 2 GPUs, graphed stages, 1f1b")
    assert "target >= 1.8x" in checks[1].detail and "target >= 3.2x" in checks[2].detail
    # Like with like: against one device replayed as one graph, whose time is
    # the graphed fit's device time (the same for every prediction).
    singles = {p["graphed_single_device_ms"] for p in out["predictions"]}
    assert len(singles) == 1 and singles.pop() > 0
    for p in out["predictions"]:
        assert p["predicted_speedup"] == pytest.approx(
            p["graphed_single_device_ms"] / p["predicted_step_ms"]
        )
    assert "x one device replayed as one graph, its device time" in checks[1].detail


def test_a_replayed_task_costs_the_host_the_same_on_any_stage() -> None:
    costs = Costs(
        stage_times=[(1.0, 2.0), (1.0, 2.0)],
        copy_times=[],
        issue_times={
            ("forward", 0): 0.2,
            ("forward", 1): 0.4,
            ("backward", 0): 0.6,
            ("backward", 1): 0.8,
        },
    )
    issue = modelcheck.task_issue([2, 1, 3], costs)
    expected = [(0.3, 0.7), (0.0, 0.0), (0.3, 0.7), (0.3, 0.7), (0.0, 0.0), (0.0, 0.0)]
    assert [v for pair in issue for v in pair] == pytest.approx(
        [v for pair in expected for v in pair]
    )

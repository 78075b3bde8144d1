"""The pass/fail logic of the doctor's steps other than the CUDA ones
(environment, correctness, the experiment, the profile, the cost model),
without a GPU."""

from __future__ import annotations

import dataclasses
import functools
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from mpstream import tutorial
from mpstream.doctor import (
    attribution,
    checks,
    costfit,
    environment,
    experiment,
    graphcost,
)
from mpstream.doctor.diagnosis import (
    FAIL,
    INFO,
    PASS,
    SKIP,
    TINY,
    Check,
    Context,
    jsonable,
    overall,
)
from mpstream.observe.cost_model import simulate
from mpstream.observe.fitting import Costs
from mpstream.observe.timeline import Span, Timeline
from mpstream.runtime.plan import PlanError
from mpstream.tutorial.design import Measurement, Results

CPU = torch.device("cpu")


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
    assert costfit.scaled(costs, 2.0).stage_times == [(2.0, 4.0), (2.0, 4.0)]
    labels = ["a", "b"]
    # "Measured" timelines that are the model's own: the error must be zero.
    small = simulate([(1.0, 2.0), (1.0, 2.0)], 0.0, 4, backward=True, devices=labels).timeline
    large = simulate([(3.0, 5.0), (3.0, 5.0)], 0.0, 2, backward=True, devices=labels).timeline
    rows = costfit.validate({2: small, 4: large}, 2, 8, True, labels)
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
    step, makespan = costfit.fastest(both)
    assert step.runs() == [2] and makespan == rows[0]["measured_ms"]
    assert costfit.validate({2: both}, 2, 8, True, labels)[0]["error"] == 0.0
    layers = [(1.0, 1.0), (1.0, 3.0), (2.0, 2.0)]
    calibrated = costfit.calibrate(layers, [2, 1], Costs([(4.0, 8.0), (1.0, 1.0)], []))
    assert calibrated == [(2.0, 2.0), (2.0, 6.0), (1.0, 1.0)]


def test_cost_model_validation_with_the_hosts_issue_time() -> None:
    labels = ["a", "b"]
    issue = {("forward", 0): 3.0, ("backward", 0): 3.0, ("forward", 1): 3.0, ("backward", 1): 3.0}
    # A host-bound "measured" step: the issue times ride on its spans.
    bound = simulate(
        [(1.0, 2.0)] * 2, 0.0, 4, backward=True, devices=labels, issue_times=issue
    ).timeline
    (row,) = costfit.validate({2: bound}, 2, 8, True, labels)
    assert row["issue_modelled"] and row["error"] == 0.0
    assert row["measured_ms"] == 48.0 and row["devices_only_ms"] == 30.0
    costs = Costs([(1.0, 2.0)] * 2, [], issue_times=issue)
    assert costfit.scaled(costs, 2.0).issue_times == issue  # kernels per task: as many
    assert costfit.spread_issue([2, 1], costs) == [(1.5, 1.5), (1.5, 1.5), (3.0, 3.0)]


def test_correctness_grid_layouts() -> None:
    # forward + 6 schedules (a V needs an even number of stages, here 3), x 3 checkpoint modes
    assert len(checks.cases((CPU, CPU))) == 7 * 3
    one = (torch.device("cuda:0"), torch.device("cuda:0"))
    two = (torch.device("cuda:0"), torch.device("cuda:1"))
    assert len(checks.cases(one)) == 2 * 3 * 7 * 3  # plain and forced copies x 3 sources
    # the round-robin schedules cannot run on cuda:0 | cuda:1 | cuda:1
    assert len(checks.cases(two)) == 2 * 3 * 7 * 3 + 3 * 4 * 3
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


def test_a_one_line_plan_error_fails_its_plan_check(monkeypatch: pytest.MonkeyPatch) -> None:
    def reject(plan: object) -> None:
        raise PlanError("op 3 waits on event 7, which was never recorded")

    monkeypatch.setattr(checks, "verify_plan", reject)
    bad = checks.plan_grid()
    assert {c.status for c in bad} == {FAIL} and "never recorded" in bad[0].detail


def test_the_correctness_figure_counts_only_plans_that_verified(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def reject(plan: object) -> None:
        raise PlanError("invalid plan:\n  forward(stage=1, micro=0) is not ordered after copy")

    monkeypatch.setattr(checks, "verify_plan", reject)
    monkeypatch.setattr(checks, "cases", lambda devices: [])
    monkeypatch.setattr(checks, "resnet_case", lambda *args: None)
    ctx = Context((CPU, CPU), TINY, "resnet50", tmp_path, tmp_path)
    result = checks.run(ctx)
    assert result.status == FAIL and result.figure.endswith("; 0 plans verified")


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
    from mpstream.doctor import runner
    from mpstream.doctor.diagnosis import FULL

    sizes = runner.sized(FULL, runner.Options(tmp_path, arch="resnet101"))
    ctx = Context((CPU, CPU), sizes, "resnet101", tmp_path, tmp_path)
    config = experiment.config_for(ctx)
    assert (config.arch, config.split_size, config.split_sizes) == ("resnet101", 8, (8, 12, 20))
    # Split sizes given: the first is the main one, for IDRIS's variant too.
    given = runner.Options(tmp_path, arch="resnet101", split_sizes=(16, 4))
    config = runner.sized(FULL, given).experiment
    assert (config.split_size, config.split_sizes) == (16, (4, 16))  # the sweep in order
    # A batch of 8 holds IDRIS's split size 8: still the main one.
    eight = runner.Options(tmp_path, arch="resnet101", batch_size=8)
    assert runner.sized(FULL, eight).experiment.split_sizes == (8,)  # 12 and 20 do not fit
    assert runner.sized(TINY, eight).experiment.split_size == 8
    ctx = Context(
        (CPU, CPU), runner.sized(FULL, runner.Options(tmp_path)), "resnet50", tmp_path, tmp_path
    )
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


def test_the_pinned_input_target_shows_each_rounds_ratio() -> None:
    # H200, ResNet-101: medians 0.93x, while the rounds ranged 0.85-1.08.
    resident = Measurement(experiment.RESIDENT, 8, [1.415, 1.346, 1.686, 1.470, 1.493])
    pinned = Measurement(experiment.PINNED, 8, [1.411, 1.579, 1.685, 1.608, 1.383])
    check = experiment.pinned_throughput(resident, pinned)
    assert check.detail == "0.93x (rounds 0.85-1.08), target >= 0.98x: missed"
    assert check.status == INFO  # a missed target is reported, neither PASS nor FAIL
    assert check.data["rounds"][0] == pytest.approx(1.415 / 1.411)
    one = experiment.pinned_throughput(Measurement("a", 8, [1.0]), Measurement("b", 8, [1.0]))
    assert one.detail == "1.00x, target >= 0.98x: met" and one.status == PASS
    assert [experiment.target_status(ok) for ok in (True, False)] == [PASS, INFO]


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


def test_graphed_stages_are_profiled_and_predicted_where_a_profile_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a GPU step 7 profiles the main split again with graphed stages and
    # step 8 fits it; here the same functions run on a CPU profile.
    ctx = Context((CPU, CPU), TINY, "resnet50", tmp_path, tmp_path)
    config = experiment.config_for(ctx)
    assert graphcost.graphed_predictions(ctx, (1, 1.0), [], 1.0, [], []) == {}  # no profile
    ctx.shared["graphed_profile"] = attribution.profile_step(ctx, config.split_size, graphs=True)
    layer = types.SimpleNamespace(output_bytes=1000, forward_ms=1.0, backward_ms=2.0)
    profiled = [layer] * 23
    checks: list[Check] = []
    out = graphcost.graphed_predictions(ctx, (4, 1.0), profiled, 10.0, ["cpu", "cpu"], checks)
    assert [(p["schedule"], p["gpus"]) for p in out["predictions"]] == [
        ("gpipe", 2),
        ("gpipe", 4),
        ("1f1b", 2),
        ("1f1b", 4),
    ]
    names = [c.name for c in checks]
    assert {c.status for c in checks} == {INFO}  # figures against targets, no verdicts
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
    # Without step 7's measured single device (as here), the fit's device time
    # over the micro-batches stands in, and says so.
    assert "x one device replaying the micro-batches, its device time from the fit" in (
        checks[1].detail
    )
    assert not any(p["baseline_measured"] for p in out["predictions"])
    # Last, each task kind's host issue time: the fit's median beside the minimum.
    assert names[-1] == "graphed stages: host issue per task (median / min, ms)"
    assert "forward 0: " in checks[-1].detail and checks[-1].data["tasks"][0][2] >= 1
    # With step 7's rows, the single device's step captured as one graph, as
    # measured: a 15-micro-batch pipeline no longer gets credit for it.
    ctx.shared["graphed_schedules"] = [
        {"schedule": "single device", "captured step": {"step_ms": 3.0}},
        {"schedule": "gpipe", "captured step": {"step_ms": 9.0}},
    ]
    again = graphcost.graphed_predictions(ctx, (4, 1.0), profiled, 10.0, ["cpu", "cpu"], [])
    for p, q in zip(again["predictions"], out["predictions"]):
        assert p["baseline_measured"] and p["graphed_single_device_ms"] == 3.0
        assert p["predicted_speedup"] == pytest.approx(3.0 / q["predicted_step_ms"])
    # A batch the split size does not divide: its last micro-batch, half a
    # full one, costs its share on the pipeline and on the one device (the
    # graphed predictions counted every micro-batch full). The same fitted
    # costs for both, to compare the predictions alone.
    del ctx.shared["graphed_schedules"]
    fitted = graphcost.fit(costfit.fastest(ctx.shared["graphed_profile"]["timeline"])[0])
    monkeypatch.setattr(graphcost, "fit", lambda step, last: fitted)
    full = graphcost.graphed_predictions(ctx, (4, 1.0), profiled, 10.0, ["cpu", "cpu"], [])
    short = graphcost.graphed_predictions(ctx, (4, 0.5), profiled, 10.0, ["cpu", "cpu"], [])
    for p, q in zip(short["predictions"], full["predictions"]):
        assert p["graphed_single_device_ms"] == pytest.approx(
            3.5 / 4 * q["graphed_single_device_ms"]
        )
        # (here the host issue times, not scaled, set the pace)
        assert p["predicted_step_ms"] <= q["predicted_step_ms"]


def test_the_captured_single_device_is_read_from_step_7s_rows() -> None:
    rows = [{"schedule": "single device", "captured step": {"step_ms": 33.9}}]
    assert graphcost.captured_single(rows) == 33.9
    assert graphcost.captured_single(None) is None
    failed = [{"schedule": "single device", "captured step": {"error": "OOM", "step_ms": None}}]
    assert graphcost.captured_single(failed) is None
    assert graphcost.captured_single([{"schedule": "gpipe", "captured step": {}}]) is None


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
    issue = graphcost.task_issue([2, 1, 3], costs)
    expected = [(0.3, 0.7), (0.0, 0.0), (0.3, 0.7), (0.3, 0.7), (0.0, 0.0), (0.0, 0.0)]
    assert [v for pair in issue for v in pair] == pytest.approx(
        [v for pair in expected for v in pair]
    )

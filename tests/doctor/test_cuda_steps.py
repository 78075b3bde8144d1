"""The pass/fail logic of the doctor's CUDA steps (overlap, races, memory),
and what of them runs without a GPU."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from mpstream import GraphWarning
from mpstream.doctor import (
    overlap,
    probes,
    sanitizer,
    soak,
)
from mpstream.doctor.diagnosis import FAIL, PASS, SKIP, TINY, Check, Context
from mpstream.observe.cost_model import simulate
from mpstream.observe.timeline import Span, Timeline
from mpstream.schedules.schedule import SCHEDULES

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


def test_a_csan_run_that_did_not_finish_claims_no_race_count(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    timed_out = Check("CSAN", FAIL, "did not finish within 60 s", {"log": "csan.log"})
    skipped = Check("memcheck", SKIP, "compute-sanitizer is not on the PATH")
    monkeypatch.setattr(sanitizer, "csan", lambda *args: timed_out)
    monkeypatch.setattr(sanitizer, "memcheck", lambda *args: skipped)
    result = sanitizer.run(Context((CPU, CPU), TINY, "resnet50", tmp_path, tmp_path))
    assert result.status == FAIL and "race reports" not in result.figure
    assert result.figure.startswith("CSAN: did not finish within 60 s")


def test_memcheck_verdicts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ok = f"{sanitizer.DONE}\n========= ERROR SUMMARY: 0 errors\n"
    assert sanitizer.judge_memcheck(0, ok) == (PASS, "ERROR SUMMARY: 0 errors", 0)
    bad = "========= Invalid __global__ read\n========= ERROR SUMMARY: 3 errors\n"
    assert sanitizer.judge_memcheck(1, bad)[::2] == (FAIL, 3)
    assert sanitizer.judge_memcheck(0, sanitizer.DONE)[0] == FAIL  # no summary: no verdict
    monkeypatch.setattr(shutil, "which", lambda name: None)
    check = sanitizer.memcheck(["cuda:0"], 10, tmp_path / "m.log")
    assert check.status == SKIP and "not on the PATH" in check.detail


def test_graphed_memcheck_verdicts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean = "========= ERROR SUMMARY: 0 errors\n"
    ok = f"{sanitizer.GRAPHED}\n{sanitizer.DONE}\n{clean}"
    assert sanitizer.judge_graphed(0, ok)[0] == PASS
    # Every stage fell back to eager: memcheck saw no graph, so no verdict.
    status, detail, _ = sanitizer.judge_graphed(0, f"{sanitizer.DONE}\n{clean}")
    assert status == SKIP and "no graph ran under memcheck" in detail
    bad = (
        f"{sanitizer.GRAPHED}\n========= Invalid __global__ read\n========= ERROR SUMMARY: 1 error"
    )
    assert sanitizer.judge_graphed(0, bad)[::2] == (FAIL, 1)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    check = sanitizer.memcheck(["cuda:0"], 10, tmp_path / "m.log", graphs=True)
    assert check.status == SKIP and check.name.endswith(", graphed stages")


def test_the_graphed_workload_runs_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.warns(GraphWarning, match="runs eagerly: on cpu"):
        sanitizer.graphed_workload("cpu")
    out = capsys.readouterr().out
    assert sanitizer.DONE in out and sanitizer.GRAPHED not in out  # no CUDA graph on a CPU


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

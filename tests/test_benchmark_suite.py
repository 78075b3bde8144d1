"""The benchmark suite's own plumbing (``benchmarks/conftest.py``): a run
records and prints its devices and sizes, and comparing with a run saved on
other devices or at other sizes warns, naming what differs."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import conftest


class _Logger:
    def __init__(self) -> None:
        self.said: list[str] = []

    def warning(self, text: str) -> None:
        self.said.append(text)


class _Session:
    def __init__(self) -> None:
        self.logger = _Logger()


def _compare(now: dict[str, Any], saved: dict[str, Any] | None) -> list[str]:
    session = _Session()
    compared = {"machine_info": {} if saved is None else {conftest.INFO_KEY: saved}}
    conftest.pytest_benchmark_compare_machine_info(
        None,  # type: ignore[arg-type]
        session,
        {conftest.INFO_KEY: now},
        compared,
    )
    return session.logger.said


def test_a_saved_run_records_its_devices_and_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPSTREAM_BENCH_DEVICES", "cpu")
    machine_info: dict[str, Any] = {}
    conftest.pytest_benchmark_update_machine_info(None, machine_info)  # type: ignore[arg-type]
    info = machine_info[conftest.INFO_KEY]
    assert info["devices"] == ["cpu", "cpu"]
    assert info["torch"] == torch.__version__
    assert info["torch_threads"] == torch.get_num_threads()
    if not torch.cuda.is_available():
        assert info["sizes"] == "CPU (reduced)"


def test_a_cpu_run_says_its_numbers_are_not_gpu_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPSTREAM_BENCH_DEVICES", "cpu,cpu")
    line = conftest.pytest_report_header(None)  # type: ignore[arg-type]
    assert "devices cpu, cpu" in line
    assert "not GPU numbers" in line
    gpu = {**conftest.run_info(), "devices": ["cuda:0", "cuda:1"], "device_names": ["H100"] * 2}
    assert "not GPU numbers" not in conftest.header(gpu)


def test_bad_bench_devices_are_named_in_the_header(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPSTREAM_BENCH_DEVICES", "tpu:0")
    said = "MPSTREAM_BENCH_DEVICES='tpu:0': 'tpu:0' is not a device name"
    assert said in conftest.pytest_report_header(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=said):
        conftest.suite_devices()


def test_comparing_with_a_run_on_other_devices_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPSTREAM_BENCH_DEVICES", "cpu")
    now = {**conftest.run_info(), "sizes": "CPU (reduced)"}
    gpu = {**now, "devices": ["cuda:0", "cuda:1"], "sizes": "GPU (the tutorial's)"}
    (said,) = _compare(now, gpu)
    assert "devices: ['cuda:0', 'cuda:1'] -> ['cpu', 'cpu']" in said
    assert "sizes: GPU (the tutorial's) -> CPU (reduced)" in said
    assert "not like with like" in said


def test_comparing_with_a_run_on_the_same_devices_is_quiet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MPSTREAM_BENCH_DEVICES", "cpu")
    now = conftest.run_info()
    # Another torch is what a comparison across releases is for: no warning.
    assert _compare(now, {**now, "torch": "2.0.0"}) == []


def test_comparing_with_a_run_that_did_not_record_them_warns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MPSTREAM_BENCH_DEVICES", "cpu")
    (said,) = _compare(conftest.run_info(), None)
    assert "the saved run did not record them" in said


def test_the_header_in_the_docs_is_the_one_printed() -> None:
    docs = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
    (shown,) = [
        line for line in docs.read_text().splitlines() if line.startswith("mpstream suite:")
    ]
    example = {
        "devices": ["cpu", "cpu"],
        "device_names": ["AMD EPYC (2 threads)"] * 2,
        "sizes": "CPU (reduced)",
        "torch": "2.15.0+cu132",
    }
    assert conftest.header(example) == shown


def test_the_transformer_group_runs_on_the_suites_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    # It picked its own devices, so MPSTREAM_BENCH_DEVICES (which the run
    # records) did not apply to it: a bad value was not even noticed.
    from benchmarks import test_transformer

    named: list[str | None] = []

    def detect(spec: str | None = None) -> tuple[torch.device, torch.device]:
        named.append(spec)
        return torch.device("cpu"), torch.device("cpu")

    monkeypatch.setenv("MPSTREAM_BENCH_DEVICES", "cuda:0,cuda:0")
    monkeypatch.setattr(conftest.bench, "detect_devices", detect)
    try:
        assert importlib.reload(test_transformer).DEVICES == (torch.device("cpu"),) * 2
        assert named == ["cuda:0,cuda:0"]
    finally:
        monkeypatch.undo()
        importlib.reload(test_transformer)


def test_the_sizes_follow_the_suites_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    # They followed torch.cuda.is_available(): MPSTREAM_BENCH_DEVICES=cpu on a
    # GPU machine timed the tutorial's sizes on the CPU and asked the CUDA
    # allocator for a CPU pipe's memory.
    monkeypatch.setenv("MPSTREAM_BENCH_DEVICES", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        suite = importlib.reload(conftest)
        assert not suite.ON_GPU
        assert suite.TUTORIAL.batch_size == suite.bench.QUICK.batch_size
        assert suite.run_info()["sizes"] == "CPU (reduced)"
    finally:
        monkeypatch.undo()
        importlib.reload(conftest)


def test_the_schedules_group_places_its_stages_on_the_suites_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On a machine with two GPUs it put its stages on cuda:0 and cuda:1 in
    # turn whatever MPSTREAM_BENCH_DEVICES said (cuda:0,cuda:0 included).
    from benchmarks import test_schedules

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    gpu0, gpu1, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    assert test_schedules._devices((gpu0, gpu0)) == [gpu0] * 4
    assert test_schedules._devices((gpu1, gpu0)) == [gpu1, gpu0, gpu1, gpu0]
    assert test_schedules._devices((cpu, gpu1)) == [cpu, gpu1, cpu, gpu1]


def test_the_overhead_group_issues_on_the_suites_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    # It took cuda:0 wherever CUDA was there, whatever MPSTREAM_BENCH_DEVICES
    # said, and recorded that device; then the first of the suite's two
    # only, while the run recorded both.
    from benchmarks import test_overhead

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert test_overhead._issue_devices((cpu, cpu)) == [cpu] * 4
    assert test_overhead._issue_devices((gpu1, gpu1)) == [gpu1] * 4
    assert test_overhead._issue_devices((gpu0, gpu1)) == [gpu0, gpu1, gpu0, gpu1]
    assert test_overhead._issue_devices((cpu, gpu1)) == [cpu, gpu1, cpu, gpu1]


def test_the_header_names_each_devices_model_where_they_differ() -> None:
    # "cpu, cuda:0 (AMD EPYC, H100)" left the reader to pair them.
    mixed = {
        "devices": ["cpu", "cuda:0"],
        "device_names": ["AMD EPYC (2 threads)", "NVIDIA H100"],
        "sizes": "GPU (the tutorial's)",
        "torch": "2.15.0+cu132",
    }
    line = conftest.header(mixed)
    assert "devices cpu (AMD EPYC (2 threads)), cuda:0 (NVIDIA H100), sizes" in line

"""Shared setup of the benchmark suite: devices, sizes, and what a saved run records.

Two GPUs: the tutorial's ``cuda:0``/``cuda:1``; one GPU: both halves on
``cuda:0``; no GPU: the CPU at a reduced size. ``MPSTREAM_BENCH_DEVICES``
(``cuda:0,cuda:1``) overrides the detection, and the sizes follow it.

pytest-benchmark compares a run with a saved one by test name alone, and
names its storage folder by the operating system and Python only: a CPU run
and a GPU run, or runs on other devices, land side by side under the same
names. So each run's ``machine_info`` records the devices and sizes
(:func:`run_info`), the header says them (a CPU run says its numbers are
not GPU numbers), and ``--benchmark-compare`` against a run timed on other
devices or at other sizes warns, naming what differs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch

from mpstream.tutorial import bench
from mpstream.tutorial.machine import named_devices


def suite_devices() -> tuple[torch.device, torch.device]:
    """The suite's two devices: ``MPSTREAM_BENCH_DEVICES``, else detected.

    Raises:
        ValueError: ``MPSTREAM_BENCH_DEVICES`` names no usable devices.
    """
    spec = os.environ.get("MPSTREAM_BENCH_DEVICES")
    try:
        return bench.detect_devices(spec)
    except ValueError as e:  # said as the command line's --devices: name the variable
        said = str(e).removeprefix("--devices: ")
        raise ValueError(f"MPSTREAM_BENCH_DEVICES={spec!r}: {said}") from None


def _on_gpu() -> bool:
    # The sizes follow the devices the suite runs on, not whether CUDA is
    # there: MPSTREAM_BENCH_DEVICES=cpu on a GPU machine times the CPU's sizes
    # (and measures memory as the CPU's), not the tutorial's on the CPU.
    try:
        return any(d.type == "cuda" for d in suite_devices())
    except ValueError:  # raised again, naming the variable, where the devices are used
        return torch.cuda.is_available()


ON_GPU = _on_gpu()

# Group "tutorial": the tutorial's sizes on a GPU; on the CPU the quick size,
# so the four models take about a minute including warm-up.
TUTORIAL = bench.FULL if ON_GPU else dataclasses.replace(bench.QUICK, repeat=3)
# Group "split_size": the tutorial's sweep needs 60 images per batch so that
# every split size differs; on the CPU one smaller-image batch of 60.
SWEEP = (
    bench.FULL
    if ON_GPU
    else dataclasses.replace(bench.QUICK, num_batches=1, batch_size=60, repeat=2)
)
SPLIT_SIZES = bench.FULL.split_sizes

# The key of this suite's entry in pytest-benchmark's machine_info.
INFO_KEY = "mpstream"


@pytest.fixture(scope="session")
def devices() -> tuple[torch.device, torch.device]:
    return suite_devices()


def run_info() -> dict[str, Any]:
    """What the suite's times depend on besides the code: the devices
    (``MPSTREAM_BENCH_DEVICES`` or detected), their names, the sizes (set by
    the devices) and the versions.

    Raises:
        ValueError: ``MPSTREAM_BENCH_DEVICES`` names no usable devices.
    """
    devs = suite_devices()
    return {
        "devices": [str(d) for d in devs],
        "device_names": [bench.device_name(d) for d in devs],
        "sizes": "GPU (the tutorial's)" if ON_GPU else "CPU (reduced)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
    }


def header(info: dict[str, Any]) -> str:
    """The line the run's header prints from :func:`run_info`."""
    where = named_devices(info["devices"], info["device_names"])
    line = f"mpstream suite: devices {where}, sizes {info['sizes']}, torch {info['torch']}"
    if all(d == "cpu" for d in info["devices"]):
        line += (
            "; CPU numbers: the stages run one after another on the host, nothing overlaps,"
            " so they are not GPU numbers"
        )
    return line


def differences(now: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    """What :func:`run_info` of this run and of a saved run disagree on, as
    ``key: saved -> now``; a run saved before the suite recorded it says so."""
    if not saved:
        return ["devices and sizes: unknown, the saved run did not record them"]
    # The versions differ on purpose when comparing torch releases; the
    # devices and sizes make the same test name time something else.
    keys = ("devices", "device_names", "sizes", "torch_threads")
    return [f"{k}: {saved.get(k)} -> {now.get(k)}" for k in keys if saved.get(k) != now.get(k)]


def pytest_report_header(config: pytest.Config) -> str:
    try:
        return header(run_info())
    except ValueError as e:  # raised again where the devices are used
        return f"mpstream suite: {e}"


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(
    config: pytest.Config, machine_info: dict[str, Any]
) -> None:
    machine_info[INFO_KEY] = run_info()


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_compare_machine_info(
    config: pytest.Config,
    benchmarksession: Any,
    machine_info: dict[str, Any],
    compared_benchmark: dict[str, Any],
) -> None:
    saved = compared_benchmark.get("machine_info", {}).get(INFO_KEY, {})
    changed = differences(machine_info.get(INFO_KEY, {}), saved)
    if changed:
        benchmarksession.logger.warning(
            "the compared run is not like with like: the same test names, other devices or "
            "sizes ("
            + "; ".join(changed)
            + "), so its ratios compare the machines, not the code; compare with a run saved "
            "on the same devices (--benchmark-storage=DIR keeps one machine's runs apart)"
        )

"""Where the tutorial's experiment runs, and what a result records of it.

:func:`detect_devices` picks (or checks) the experiment's two devices,
:func:`device_name` names one for a reader, :func:`metadata` is what a
result file says about its run: the versions, the commit, the host and the
devices. ``mpstream bench`` (:mod:`.bench` re-exports these four),
``mpstream trace``, ``mpstream schedules`` and the doctor share them.
:func:`named_devices` names each of a run's devices with its model, as the
headers of ``mpstream bench`` and of the benchmark suite print them.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from .._words import count_of

__all__ = ["detect_devices", "device_name", "named_devices", "git_commit", "metadata"]


def detect_devices(spec: str | None = None) -> tuple[torch.device, torch.device]:
    """The two devices of the experiment.

    Args:
        spec: ``"cuda:0,cuda:1"``-style, or one device for both halves
            (``"cuda:0"``); default two GPUs if present, else both halves
            on ``cuda:0``, else both on the CPU.

    Raises:
        ValueError: ``spec`` does not name one or two usable devices.
    """
    if spec is None:
        if torch.cuda.is_available():
            second = 1 if torch.cuda.device_count() > 1 else 0
            return torch.device("cuda", 0), torch.device("cuda", second)
        return torch.device("cpu"), torch.device("cpu")
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) not in (1, 2):
        raise ValueError(f"--devices takes one or two comma-separated devices, got {spec!r}")
    if len(parts) == 1:
        parts *= 2
    devs = []
    for p in parts:
        try:
            d = torch.device(p)
        except RuntimeError:
            raise ValueError(f"--devices: {p!r} is not a device name") from None
        if d.type not in ("cpu", "cuda"):
            raise ValueError(f"--devices: {d} is not a cpu or cuda device")
        if d.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"--devices: {d} requested but CUDA is not available")
            count = torch.cuda.device_count()
            if d.index is None:
                d = torch.device("cuda", 0)
            if d.index is not None and d.index >= count:
                raise ValueError(f"--devices: {d} does not exist ({count} GPU(s))")
        devs.append(d)
    return devs[0], devs[1]


def device_name(device: torch.device) -> str:
    """A human name for ``device``: the GPU model or the CPU."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    threads = count_of(os.cpu_count() or 0, "thread")
                    return f"{line.split(':', 1)[1].strip()} ({threads})"
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def named_devices(devices: Sequence[torch.device | str], names: Sequence[str] | None = None) -> str:
    """The devices with their models, as a run's header says them.

    Devices of one model name it once (``cuda:0, cuda:1 (NVIDIA H100)``);
    devices of different models each name their own (``cpu (AMD EPYC),
    cuda:0 (NVIDIA H100)``), so a mixed run does not pass for one machine.

    Args:
        devices: the run's devices, in order.
        names: their models as :func:`device_name` gives them (a saved
            run's record); default asked of this machine.

    Returns:
        The devices and their models, comma-separated.

    Raises:
        ValueError: ``names`` does not give one name per device.
    """
    if names is None:
        names = [device_name(torch.device(d)) for d in devices]
    if len(names) != len(devices):
        raise ValueError(
            f"{count_of(len(devices), 'device')} but {count_of(len(names), 'name')}: give one per "
            f"device"
        )
    if len(set(names)) == 1:
        return f"{', '.join(str(d) for d in devices)} ({names[0]})"
    return ", ".join(f"{d} ({name})" for d, name in zip(devices, names, strict=True))


def git_commit() -> str | None:
    """``$MPSTREAM_COMMIT`` if set (a copy of the tree on a remote GPU
    machine names its commit that way: any ``.git`` travelling with it may
    be stale), else the checkout's commit, else None."""
    named = os.environ.get("MPSTREAM_COMMIT")
    if named:
        return named
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def metadata(devices: Sequence[torch.device]) -> dict[str, Any]:
    """Where and with what a run was measured."""
    return {
        "mpstream": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "git_commit": git_commit(),
        "devices": [str(d) for d in devices],
        "device_names": [device_name(d) for d in devices],
        "python": platform.python_version(),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }

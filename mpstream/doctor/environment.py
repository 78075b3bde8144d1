"""Doctor step 1: what the run is measured on, and whether ``mpstream._C`` fits the torch.

GPU names, memory and count, the driver, torch, CUDA, cuDNN, Python, mpstream's
version and git commit, and the torch the C++ extension was built for. The
driver comes from ``nvidia-smi``, else ``/proc/driver/nvidia/version``.
"""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch

from .. import _ext
from .._version import __version__
from ..runtime import missing as missing_private_calls
from ..tutorial.bench import device_name, git_commit
from .diagnosis import FAIL, PASS, SKIP, Check, Context, StepResult, overall

__all__ = ["gpus", "driver_version", "extension_build", "collect", "run"]


def gpus() -> list[dict[str, Any]]:
    """Each visible GPU: index, name, memory (GiB) and compute capability."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append(
            {
                "index": i,
                "name": props.name,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "capability": f"{props.major}.{props.minor}",
                "multiprocessors": props.multi_processor_count,
            }
        )
    return out


def driver_version() -> str | None:
    """The NVIDIA driver version, or None without one."""
    if shutil.which("nvidia-smi"):
        try:
            done = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            first = done.stdout.strip().splitlines()
            if first:
                return first[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    found = re.search(r"Kernel Module\s+(\S+)", text)
    return found.group(1) if found else text.splitlines()[0].strip()


def extension_build() -> dict[str, Any]:
    """Whether ``mpstream._C`` loads and was built for the installed torch."""
    stamp = Path(_ext.__file__).with_name("_build.json")
    try:
        built: dict[str, Any] = json.loads(stamp.read_text())
    except (OSError, ValueError):
        built = {}
    try:
        ext = _ext.load()
    except _ext.ExtensionError as exc:
        return {"ok": False, "error": str(exc).splitlines()[0], "stamp": built}
    return {
        "ok": True,
        "built_for_torch": str(ext.torch_version()),
        "installed_torch": torch.__version__,
        "file": str(getattr(ext, "__file__", "")),
        "stamp": built,
    }


def collect(devices: tuple[torch.device, torch.device]) -> dict[str, Any]:
    """Every fact of the environment, JSON-ready."""
    cudnn = (
        torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
        if torch.backends.cudnn.is_available()  # type: ignore[no-untyped-call]
        else None
    )
    return {
        "gpus": gpus(),
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "driver": driver_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": platform.node(),
        "cpu": device_name(torch.device("cpu")),
        "mpstream": __version__,
        "git_commit": git_commit(),
        "extension": extension_build(),
        "devices": [str(d) for d in devices],
    }


def run(ctx: Context) -> StepResult:
    """Collects the environment; FAILs only if the extension does not fit the
    torch or the torch lacks a private call mpstream makes."""
    env = collect(ctx.devices)
    ctx.shared["environment"] = env
    ext = env["extension"]
    checks = [
        Check(
            "mpstream._C built for the installed torch",
            PASS if ext["ok"] else FAIL,
            f"built for {ext.get('built_for_torch')}" if ext["ok"] else ext["error"],
        )
    ]
    lacking = [f"{p.module}.{p.name} ({p.needed_for})" for p in missing_private_calls()]
    checks.append(
        Check(
            "torch's private calls mpstream makes",
            FAIL if lacking else PASS,
            f"missing: {', '.join(lacking)}" if lacking else "all present",
        )
    )
    if env["gpus"]:
        names = sorted({g["name"] for g in env["gpus"]})
        memory = env["gpus"][0]["memory_gib"]
        where = f"{env['gpu_count']} x {', '.join(names)} ({memory} GiB)"
        checks.append(Check("CUDA devices", PASS, where))
    else:
        where = f"no CUDA device ({env['cpu']})"
        checks.append(Check("CUDA devices", SKIP, "none: the GPU steps will SKIP"))
    figure = (
        f"{where}, driver {env['driver'] or '-'}, torch {env['torch']}, "
        f"CUDA {env['cuda'] or '-'}, mpstream {env['mpstream']} @ {(env['git_commit'] or '-')[:9]}"
    )
    status = FAIL if overall(checks) == FAIL else PASS
    return StepResult("environment", "Environment", status, figure, checks=checks, data=env)

"""The Makefile's ``SYSTEM_TORCH=1``: a venv on the interpreter's own torch.

What it runs is read from ``make -n``; the refusal, when the interpreter's
torch and torchvision do not import, is run for real (it stops before any
venv exists). Building a whole venv is left to ``make`` itself.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_it_builds_on_the_system_packages_and_installs_all_but_torch(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    result = make("-n", "setup", "SYSTEM_TORCH=1", f"VENV={venv}")
    assert result.returncode == 0, result.stderr
    commands = result.stdout.splitlines()
    assert any(c.endswith(f" -m venv --system-site-packages {venv}") for c in commands)
    (grep,) = [c for c in commands if c.startswith("grep ")]
    venv.mkdir()
    subprocess.run(grep, shell=True, cwd=ROOT, check=True)
    kept = (venv / "requirements-no-torch.txt").read_text().splitlines()
    pinned = (ROOT / "requirements.txt").read_text().splitlines()
    names = [line.split("==")[0] for line in pinned if "==" in line]
    assert {"torch", "torchvision"} <= set(names)
    assert [line.split("==")[0] for line in kept if "==" in line] == [
        n for n in names if n not in ("torch", "torchvision")
    ]
    # Without the option nothing changes: the pinned pair goes into the venv.
    plain = make("-n", "setup", f"VENV={venv}").stdout
    assert "--system-site-packages" not in plain and "-r requirements.txt" in plain


def test_it_stops_with_the_reason_when_torch_does_not_import(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    # -S: no site-packages, so neither torch nor torchvision imports.
    python = f"{shlex.quote(sys.executable)} -S"
    result = make("setup", "SYSTEM_TORCH=1", f"VENV={venv}", f"PYTHON={python}")
    assert result.returncode != 0
    assert "SYSTEM_TORCH=1:" in result.stderr
    assert "cannot import torch and torchvision (ModuleNotFoundError" in result.stderr
    assert not venv.exists()

"""The examples run as documented (tiny sizes, CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("transformer.py", ["--steps", "2", "--batch", "4", "--context", "8", "--width", "16"]),
        ("unet.py", ["--steps", "2", "--batch", "4", "--size", "16", "--split-size", "2"]),
    ],
)
def test_example_trains_and_matches_the_unsplit_model(script: str, args: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--devices", "cpu,cpu,cpu,cpu", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "equals the unsplit model's" in result.stdout
    assert "step   2" in result.stdout

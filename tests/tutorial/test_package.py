"""``mpstream.tutorial`` loads its models (and torchvision) on first use:
what it exports is there all the same."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mpstream.tutorial as tutorial
from mpstream.tutorial import graphed, loops, models


def test_the_exports_are_the_models_the_loops_and_the_graphed_ones() -> None:
    assert tutorial.__all__ == [*models.__all__, *loops.__all__, *graphed.__all__]
    assert tutorial.train is loops.train
    assert tutorial.StreamPipelineResNet50 is models.StreamPipelineResNet50
    assert tutorial.models is models
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = tutorial.nothing  # type: ignore[attr-defined]


def test_its_machine_imports_without_the_models() -> None:
    code = (
        "import sys, mpstream.tutorial.machine, mpstream.tutorial.rounds; "
        "print(sorted(m for m in sys.modules if m.startswith(('torchvision', 'mpstream.tutor'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == str(
        ["mpstream.tutorial", "mpstream.tutorial.machine", "mpstream.tutorial.rounds"]
    )

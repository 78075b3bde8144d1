"""The tuning tests' fake clock, as a fixture they ask for."""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest

from mpstream.observe import tuning
from tests.observe.curves import CLOCK


@pytest.fixture
def tune_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """tune() reads :data:`tests.observe.curves.CLOCK` for its time."""
    monkeypatch.setattr(tuning, "time", types.SimpleNamespace(perf_counter=lambda: CLOCK[0]))
    yield

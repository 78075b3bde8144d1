"""The tutorial's studies (:mod:`mpstream.tutorial.analysis`) profile the
model the run measures."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from mpstream.tutorial import analysis
from mpstream.tutorial.bench import QUICK


class Profiled(Exception):
    """Stops the prediction once the profiled model is known."""


def test_predict_scaling_profiles_the_configured_number_of_classes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[nn.Module] = []

    def profile_layers(model: nn.Module, *args: Any, **kwargs: Any) -> None:
        seen.append(model)
        raise Profiled

    monkeypatch.setattr(analysis, "profile_layers", profile_layers)
    config = dataclasses.replace(QUICK, num_classes=10)
    with pytest.raises(Profiled):
        analysis.predict_scaling(torch.device("cpu"), config)
    fc = seen[0].fc
    assert isinstance(fc, nn.Linear) and fc.out_features == 10


class _Profile:
    """A profile that saw nothing, keeping its figure's title."""

    titles: list[str] = []

    def __enter__(self) -> _Profile:
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def export_chrome_trace(self, path: Any) -> None:
        pass

    def plot(self, path: Any, *, title: str) -> None:
        self.titles.append(title)

    def summary(self, echo: bool) -> Any:
        return Summary()


class Summary:
    def to_dict(self) -> dict[str, Any]:
        return {}


@pytest.mark.parametrize(("steps", "said"), [(1, "the one step traced"), (3, "last of 3 steps")])
def test_the_trace_figure_says_how_many_steps_it_ran(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, steps: int, said: str
) -> None:
    # It read "last of 1 steps".
    monkeypatch.setattr(analysis, "profile", lambda model: _Profile())
    monkeypatch.setattr(analysis.loops, "train", lambda *a, **k: None)
    _Profile.titles = []
    config = dataclasses.replace(QUICK, num_batches=steps, warmup=0)
    cpu = torch.device("cpu")
    analysis.trace_tutorial(cpu, cpu, config, tmp_path)
    assert f"({said}; numbers are micro-batches)" in _Profile.titles[0]

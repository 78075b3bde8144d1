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

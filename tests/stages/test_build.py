"""What Pipe refuses of the module it is given (mpstream.stages.build):
a module torch.compile wrapped, with what to do."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from mpstream import Pipe


def test_a_torch_compiled_module_is_refused_saying_to_give_the_module_and_compile() -> None:
    # Either tracer failed on torch.compile's wrapper, blaming the model's code.
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    message = "Pipe was given a torch.compile'd module (Sequential wrapped)"
    x = torch.randn(4, 3)
    with pytest.raises(TypeError, match=re.escape(message)):
        compiled = torch.compile(model)
        Pipe(compiled, chunks=2, split_points=["_orig_mod.2"], devices=["cpu", "cpu"])(x)
    pipe = Pipe(model, chunks=2, split_points=["2"], devices=["cpu", "cpu"])  # as it says
    torch.testing.assert_close(pipe(x), model(x))

"""Timing marks of a stage's backward that autograd runs after ``pipe(x)``."""

from __future__ import annotations

import torch
from torch import nn

import mpstream


def test_a_backward_counts_in_the_run_whose_forward_built_it() -> None:
    pipe = mpstream.Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=2)
    x = torch.randn(4, 4)
    with mpstream.profile(pipe) as prof:
        first, second = pipe(x), pipe(x)
        first.sum().backward()  # counted in run 2, the latest, before
        second.sum().backward()
    runs = {(s.kind, s.run) for s in prof.spans}
    assert runs == {("forward", 1), ("forward", 2), ("backward", 1), ("backward", 2)}
    assert sum(s.kind == "backward" and s.run == 1 for s in prof.spans) == 4

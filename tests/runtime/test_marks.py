"""Timing marks of a stage's backward that autograd runs after ``pipe(x)``."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn

import mpstream
from mpstream.runtime.graphed import Emulated


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


class _Two(nn.Module):
    """Hands two tensors on (a mark each) and reads them back."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(
        self, v: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        u, w = (v, v) if isinstance(v, torch.Tensor) else v
        return self.a(u), self.b(w)


def test_each_backward_pass_times_each_stage_once() -> None:
    # Marks on every tensor: a stage's span opens at the first output a pass
    # reaches and ends at the last input it computes, once per pass.
    pipe = mpstream.Pipe(nn.Sequential(_Two(), _Two()), chunks=2, devices=["cpu"] * 2)
    x = torch.randn(4, 4, requires_grad=True)
    with mpstream.profile(pipe) as prof:
        u, w = pipe(x)
        (u * w).sum().backward(retain_graph=True)
        torch.autograd.grad(u.sum(), x, retain_graph=True)
        w.sum().backward(inputs=[x])
    spans = [s for s in prof.spans if s.kind == "backward"]
    assert Counter((s.stage, s.micro) for s in spans) == {(s, m): 3 for s in (0, 1) for m in (0, 1)}
    assert all(s.end_ms >= s.start_ms for s in spans)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphed"])
@pytest.mark.filterwarnings("ignore::mpstream.runtime.graphed.GraphWarning")
def test_an_output_requires_grad_where_the_plain_models_does(graphs: bool) -> None:
    # The anchor gives every stage input a gradient path, for the end mark;
    # an output that needs a gradient only through it must not require one.
    model = nn.Sequential(_Two(), _Two()).double()
    for two in model:
        two.b.requires_grad_(False)  # type: ignore[union-attr]
    ref = copy.deepcopy(model)
    kw = {"graphs": Emulated() if graphs else False, "devices": ["cpu"] * 2}
    pipe = mpstream.Pipe(model, chunks=2, **kw)
    x = torch.randn(4, 4, dtype=torch.float64)
    with mpstream.profile(pipe) as prof:
        got, want = pipe(x), ref(x)
        assert [t.requires_grad for t in got] == [t.requires_grad for t in want] == [True, False]
        got[0].sum().backward()
        want[0].sum().backward()
    for p, r in zip(pipe.parameters(), ref.parameters()):
        assert (p.grad is None) == (r.grad is None)
        if r.grad is not None:
            torch.testing.assert_close(p.grad, r.grad)
    assert {(s.stage, s.micro) for s in prof.spans if s.kind == "backward"} == {
        (s, m) for s in (0, 1) for m in (0, 1)
    }
    frozen = mpstream.Pipe(ref.requires_grad_(False), chunks=2, **kw)
    with mpstream.profile(frozen):
        assert not any(t.requires_grad for t in frozen(x))

"""Fitting a profile of the user's own loop, where each tensor of a hop sends
its gradient in a copy of its own: the cost model takes a hop's gradient
copies of one micro-batch and backward pass as one, as a training step times
them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpstream import Pipe, profile
from mpstream.observe.fitting import fit, issue_spread
from mpstream.observe.timeline import Span, Timeline


class TwoAcross(nn.Module):
    """Stage 0 hands two tensors to stage 1: one hop of two."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.a(x)
        v = self.b(x)
        return self.c(u) + v


def test_a_hops_gradient_copies_of_one_micro_batch_fit_as_one() -> None:
    spans = [
        Span(0, m, "forward", "a", 0, 1) for m in range(2)
    ] + [  # per micro-batch, two tensors' gradient copies: 0.5 and 1.5 ms
        Span(0, m, "copy_grad", "c", 10 * m + start, 10 * m + start + length, issue_ms=length)
        for m in range(2)
        for start, length in ((5.0, 0.5), (7.0, 1.5))
    ]
    timeline = Timeline(spans, {"a": "d0", "c": "d0"})
    assert fit(timeline).hops[(0, 1)] == (0.0, 2.0)
    assert issue_spread(timeline)[("copy_grad", 0)] == (2, 2.0, 2.0, 2.0)


def test_a_profile_of_the_users_loop_has_a_gradient_copy_per_tensor() -> None:
    pipe = Pipe(TwoAcross(), chunks=2, split_points=["c"], devices=["cpu"] * 2, force_copies=True)
    with profile(pipe) as prof:
        pipe(torch.randn(4, 2)).sum().backward()
    grads = [(s.stage, s.peer, s.micro) for s in prof.spans if s.kind == "copy_grad"]
    assert sorted(grads) == [(0, 1, 0), (0, 1, 0), (0, 1, 1), (0, 1, 1)]
    copy_grad = fit(prof).copy_times[0][1]
    per_micro = sorted(
        sum(s.duration_ms for s in prof.spans if s.kind == "copy_grad" and s.micro == m)
        for m in range(2)
    )
    assert copy_grad == pytest.approx(sum(per_micro) / 2)


def test_a_hops_gradient_copies_of_two_backward_passes_fit_as_one_each() -> None:
    # One tensor per hop, one forward backed through twice (retain_graph):
    # both passes count in the forward's run, one copy and one backward of
    # the receiving stage each; a hop's copy is one pass's, not the sum.
    spans = [Span(0, m, "forward", "a", 0, 1) for m in range(2)] + [
        span
        for m in range(2)
        for start in (5.0, 9.0)
        for span in (
            Span(0, m, "copy_grad", "c", 10 * m + start, 10 * m + start + 0.5, issue_ms=0.5),
            Span(0, m, "backward", "a", 10 * m + start + 1, 10 * m + start + 2),
        )
    ]
    timeline = Timeline(spans, {"a": "d0", "c": "d0"})
    assert fit(timeline).hops[(0, 1)] == (0.0, 0.5)
    assert issue_spread(timeline)[("copy_grad", 0)] == (4, 0.5, 0.5, 0.5)


def test_a_profile_of_a_graph_backed_through_twice_fits_one_passes_copy() -> None:
    pipe = Pipe(TwoAcross(), chunks=2, split_points=["c"], devices=["cpu"] * 2, force_copies=True)
    with profile(pipe) as prof:
        out = pipe(torch.randn(4, 2))
        out.sum().backward(retain_graph=True)
        out.sum().backward()
    grads = [s.duration_ms for s in prof.spans if s.kind == "copy_grad"]
    assert len(grads) == 8  # two tensors, two micro-batches, two passes
    # Per micro-batch the mean pass, and the median of two micro-batches.
    assert fit(prof).copy_times[0][1] == pytest.approx(sum(grads) / 4)

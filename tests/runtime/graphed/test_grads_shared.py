"""Gradients of a parameter that more than one gradient store holds: the
splits of a traced pipe's two kinds of call, each with its own stores
(replays emulated on the CPU, see test_stages.py)."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated


class Masked(nn.Module):
    """Two kinds of call: with a mask and without (two traced splits)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        h = self.a(x)
        if mask is not None:
            h = h * mask
        return self.b(h)  # type: ignore[no-any-return]


def test_two_kinds_of_call_interleaved_in_one_backward_add_every_gradient() -> None:
    # The second kind's stores take .grad over from the first's within the
    # pass; the first kind's next replay must add into .grad, not into its
    # own view that .grad no longer is.
    model = Masked().double()
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu", "cpu"], chunks=2,
        graphs=Emulated(),
    )  # fmt: skip
    x, x2, mask = (torch.randn(4, 4, dtype=torch.float64) for _ in range(3))
    for _ in range(2):  # the second pass replays
        for m in (model, pipe):
            m.zero_grad()
            outs = [m(x), m(x, mask), m(x2)]  # later calls' backwards run first
            sum(y.square().sum() for y in outs).backward()
        for (name, p), q in zip(pipe.named_parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)

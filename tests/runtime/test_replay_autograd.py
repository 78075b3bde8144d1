"""A graphed stage replayed in the user's own loop (mpstream.runtime.replay_autograd)."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated, GraphWarning


class DeadBranch(nn.Module):
    """``a`` feeds only ``b``, whose output is dropped: the second stage
    (from ``b``) is given ``a``'s output and none of its outputs reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        self.b(h)
        return self.c(x)


def test_a_stage_input_no_output_reaches_gives_no_gradient_upstream() -> None:
    # Found by tests/pipe/test_random_sessions.py: the replay's backward gave
    # that input None, which ran the first stage's backward anyway and called
    # a tensor hook on a.bias with None (a hook `g * 2` raised TypeError),
    # where the plain model calls no hook.
    model = DeadBranch().double()
    plain = copy.deepcopy(model)
    pipe = Pipe(model, chunks=2, devices=["cpu"] * 2, split_points=["b"], graphs=Emulated())
    x = torch.randn(4, 2, dtype=torch.float64)
    pipe(x).sum().backward()  # captures the calls
    seen: list[Tensor | None] = []
    pipe.get_parameter("a.bias").register_hook(seen.append)
    plain.zero_grad(set_to_none=True)
    pipe.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphWarning)  # the hooked stage runs eagerly
        pipe(x).sum().backward()
    plain(x).sum().backward()
    assert seen == []
    for name, p in plain.named_parameters():
        got = pipe.get_parameter(name).grad
        if p.grad is None:
            assert got is None, name
        else:
            torch.testing.assert_close(got, p.grad)

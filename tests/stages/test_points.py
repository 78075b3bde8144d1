"""Where split points begin stages (mpstream.stages.points): work a forward
does before its first split point, in its own code or in submodules it
calls first, joins the first stage, so a pipe has as many stages as split
points and one more, with either tracer."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe


class Scaled(nn.Module):
    """A root forward that works on its input before its first child."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))

    def forward(self, x: Tensor) -> Tensor:
        x = x * 2
        return self.blocks(x)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_work_before_the_first_split_point_joins_the_first_stage(tracer: str) -> None:
    model = Scaled().double()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 3, dtype=torch.float64)
    pipe = Pipe(model, chunks=2, devices=["cpu", "cpu"], split_points=["blocks.1"],
                tracer=tracer, sample=(x,))  # fmt: skip
    assert len(pipe.partitions) == 2
    first = [n.op for n in pipe.partitions[0].graph.nodes if n.op.startswith("call")]
    assert len(first) == 2  # the product and blocks.0
    out = pipe(x)
    expected = plain(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()  # type: ignore[no-untyped-call]
    expected.sum().backward()  # type: ignore[no-untyped-call]
    for p, q in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)

"""What mpstream refuses of an exported graph reaches the user as it is,
saying what to do, not worded as torch.export failing on data-dependent
control flow."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe


class ReturnsItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.b(self.a(x)), x


class ReturnsACopy(ReturnsItsInput):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.b(self.a(x)), x.clone()


def pipe(model: nn.Module) -> Pipe:
    sample = torch.randn(4, 2)
    return Pipe(model, chunks=2, split_points=["b"], tracer="export", sample=sample)


def test_an_input_returned_unchanged_is_refused_saying_what_to_do() -> None:
    with pytest.raises(TypeError) as info:
        pipe(ReturnsItsInput())
    message = str(info.value)
    assert message.startswith("the module returns one of its inputs unchanged")
    assert "x.clone()" in message
    assert "data-dependent" not in message


def test_the_copy_it_advises_runs() -> None:
    torch.manual_seed(0)
    model = ReturnsACopy()
    x = torch.randn(4, 2)
    out, same = pipe(model)(x)
    torch.testing.assert_close(out, model(x)[0])
    assert torch.equal(same, x)

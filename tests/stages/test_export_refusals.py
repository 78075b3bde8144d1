"""What mpstream refuses of an exported graph reaches the user as it is,
saying what to do, not worded as torch.export failing on data-dependent
control flow; so does a BatchNorm torch.export cannot export."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from tests.helpers import assert_same_grads


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


class Cumulative(nn.Module):
    """A BatchNorm averaging its statistics over every batch (momentum=None)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4, momentum=None)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.norm(self.a(x)))  # type: ignore[no-any-return]


@pytest.mark.parametrize("sample", [False, True])  # exported at construction or the first call
def test_a_cumulative_batch_norm_in_training_is_refused_by_name(sample: bool) -> None:
    # It was the generic "could not export ... data-dependent control flow"
    # (torch computes the average's factor as float(num_batches_tracked)).
    x = torch.randn(4, 4)
    with pytest.raises(TypeError) as info:
        Pipe(Cumulative(), chunks=2, split_points=["b"], tracer="export",
             sample=x if sample else None)(x)  # fmt: skip
    message = str(info.value)
    assert "BatchNorm1d 'norm' in training with momentum=None" in message, message
    assert "Give it a momentum" in message and "tracer='fx'" in message
    assert "data-dependent" not in message


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_the_ways_it_advises_run_as_the_plain_model(tracer: str) -> None:
    # torch.fx runs the BatchNorm whole; in eval mode it exports.
    torch.manual_seed(0)
    model = Cumulative().double()
    if tracer == "export":
        model.eval()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=2, split_points=["b"], tracer=tracer)
    for _ in range(2):
        x = torch.randn(8, 4, dtype=torch.float64)
        out = pipe(x)
        expected = torch.cat([ref(part) for part in x.chunk(2)])
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
    assert_same_grads(pipe, ref)
    torch.testing.assert_close(dict(model.named_buffers()), dict(ref.named_buffers()))

"""Surgery on split graphs: the module's tensors each stage holds itself."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from tests.helpers import assert_same_grads


class Holder(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.register_parameter(name, nn.Parameter(torch.randn(3, dtype=torch.float64)))


class Flattened(nn.Module):
    """Reads two parameters whose names flatten alike: ``a.b_c`` and ``a_b.c``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.a_b = Holder("b_c"), Holder("c")
        self.first = nn.Linear(3, 3, dtype=torch.float64)
        self.head = nn.Linear(3, 3, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        x = self.first(x)
        return self.head(x * self.a.b_c + self.a_b.c)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_tensors_whose_names_flatten_alike_stay_apart(tracer: str) -> None:
    # One stage reading both: held under one attribute name, the second
    # replaced the first and the stage computed with one tensor twice.
    model = Flattened()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.export's own
        pipe = Pipe(copy.deepcopy(model), chunks=2, split_points=["head"], devices=["cpu"] * 2,
                    tracer=tracer, sample=x)  # fmt: skip
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.testing.assert_close(pipe.train_step(x, y, nn.MSELoss()), loss.detach())
    assert_same_grads(pipe, model)

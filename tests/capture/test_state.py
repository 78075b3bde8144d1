"""What a captured step checks was kept since capture: a refusal says
what was replaced and what to do about it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpstream import CapturedStep, Pipe
from tests.helpers import mlp


@pytest.mark.parametrize(
    ("zero_grad", "advice"),
    [(True, r"zeroes the gradients itself .*drop the"), (False, r"set_to_none=False\), or let")],
)
def test_a_replaced_gradient_is_refused_with_advice_for_the_step(
    zero_grad: bool, advice: str
) -> None:
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    pipe = Pipe(mlp([5, 8, 4]), balance=[2, 2], devices=["cpu", "cpu"], split_size=3)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    step = CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt, zero_grad=zero_grad)
    step(x, y)
    opt.zero_grad()  # set_to_none=True, out of habit
    with pytest.raises(ValueError, match=f"0.weight was replaced.*new step; .*{advice}"):
        step(x, y)

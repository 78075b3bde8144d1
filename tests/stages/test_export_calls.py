"""Calls of a module split by torch.export: extra keyword arguments a
``**kwargs`` gathers (a batch's extra keys, micro-batches of any size, a
keyword export cannot name refused by name), a model's own loss adding up
to the batch's, and a mapping batch or another keyword order taken for the
same kind of call."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from tests.helpers import assert_same_grads


class _Extras(nn.Module):
    """Takes extra keyword arguments (as a Hugging Face forward does)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, input_ids: Tensor, **kwargs: Tensor) -> Tensor:
        h = self.a(input_ids)
        if "scale" in kwargs:
            h = h * kwargs["scale"]
        return self.b(h)


def test_train_step_passes_a_batchs_extra_keys_to_kwargs() -> None:
    torch.manual_seed(0)
    model = _Extras().double()
    x, s = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    y = torch.randn(6, 2, dtype=torch.float64)
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=2,
        tracer="export", sample={"input_ids": x, "scale": s},
    )  # fmt: skip
    loss = pipe.train_step({"input_ids": x, "scale": s}, y, nn.functional.mse_loss)
    expected = nn.functional.mse_loss(model(x, scale=s), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, model)


def test_extra_keyword_arguments_run_on_micro_batches_of_any_size() -> None:
    torch.manual_seed(0)
    model = _Extras().double()
    x, s = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=2,
        tracer="export", sample={"input_ids": x, "scale": s},
    )  # fmt: skip
    torch.testing.assert_close(pipe(input_ids=x, scale=s), model(x, scale=s))  # 3 and 2 rows
    x, s = x.repeat(2, 1)[:7], s.repeat(2, 1)[:7]
    torch.testing.assert_close(pipe(input_ids=x, scale=s), model(x, scale=s))  # 4 and 3 rows
    assert len(pipe.split_report().exports) == 1


@pytest.mark.parametrize("key", ["pixel-values", "class"])
def test_a_keyword_torch_export_cannot_name_is_refused_by_name(key: str) -> None:
    x = torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match=rf"keyword argument '{key}'.*rename the key"):
        Pipe(
            _Extras().double(), split_points=["b"], devices=["cpu"] * 2, chunks=2,
            tracer="export", sample={"input_ids": x, key: x},
        )  # fmt: skip


class _OwnLoss(nn.Module):
    """Returns its own loss, reduced as ``how`` says."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.how = how

    def forward(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        h = self.b(torch.relu(self.a(x)))
        if self.how == "ce_sum":
            loss = nn.functional.cross_entropy(h, y, reduction="sum")
        elif self.how == "mse_sum":
            loss = nn.functional.mse_loss(h, nn.functional.one_hot(y, 4).double(), reduction="sum")
        else:  # a mean over the targets other than -100
            loss = nn.functional.nll_loss(nn.functional.log_softmax(h, -1), y)
        return {"loss": loss, "out": h}


@pytest.mark.parametrize("how", ["ce_sum", "mse_sum", "nll"])
def test_a_models_summed_or_nll_loss_adds_up_to_the_batchs(how: str) -> None:
    torch.manual_seed(0)
    model = _OwnLoss(how).double()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))
    y[:3] = -100 if how == "nll" else y[:3]  # micro-batch 0 has no target to count
    batch = {"x": x, "y": y}
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=4,
        tracer="export", sample=batch,
    )  # fmt: skip
    expected = model(x, y)["loss"]
    torch.testing.assert_close(pipe(**batch)["loss"], expected)
    loss = pipe.train_step(batch)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, model)


def test_a_mapping_batch_and_keyword_order_are_one_kind_of_call() -> None:
    from collections import UserDict  # a tokenizer's BatchEncoding is one

    torch.manual_seed(0)
    model = _Extras().double()
    x, s = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    y = torch.randn(6, 2, dtype=torch.float64)
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=2,
        tracer="export", sample=UserDict({"input_ids": x, "scale": s}),
    )  # fmt: skip
    pipe.train_step(UserDict({"input_ids": x, "scale": s}), y, nn.functional.mse_loss)
    pipe(input_ids=x, scale=s, other=None)
    pipe(input_ids=x, other=None, scale=s)  # the same extras in another order
    assert len(pipe.split_report().exports) == 2  # with and without other=None

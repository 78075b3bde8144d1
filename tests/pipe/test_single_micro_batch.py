"""A call with gradients that runs its batch through several stages as one
micro-batch cannot overlap them: the pipe says so once, with why and what
to do; not on every step, not for one stage, not without gradients, not
for the points of a tuning curve."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import Tensor, nn

import mpstream
from mpstream import Pipe, SingleMicroBatchWarning
from tests.helpers import mlp


def two_stages(**kwargs: object) -> Pipe:
    return Pipe(mlp([6, 8, 4]), balance=[2, 2], devices=["cpu", "cpu"], **kwargs)  # type: ignore[arg-type]


def batch(rows: int = 8) -> tuple[Tensor, Tensor]:
    return torch.randn(rows, 6, dtype=torch.float64), torch.randn(rows, 4, dtype=torch.float64)


def user_loop(pipe: Pipe, x: Tensor, y: Tensor) -> None:
    nn.functional.mse_loss(pipe(x), y).backward()


def train_step(pipe: Pipe, x: Tensor, y: Tensor) -> None:
    pipe.train_step(x, y, nn.MSELoss())


RUNS = {"loop": user_loop, "train_step": train_step}


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"chunks": 1}, r"chunks=1"),
        ({"split_size": 8}, r"split_size=8 >= the batch's 8 rows"),
        ({}, r"neither chunks nor split_size"),
    ],
)
def test_one_micro_batch_through_several_stages_is_said_once(
    run: str, kwargs: dict[str, object], why: str
) -> None:
    pipe = two_stages(**kwargs)
    x, y = batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            RUNS[run](pipe, x, y)
    said = [w for w in caught if issubclass(w.category, SingleMicroBatchWarning)]
    assert len(said) == 1, [str(w.message) for w in said]
    text = str(said[0].message)
    assert "one micro-batch through 2 stages" in text and "nothing overlaps" in text
    assert "chunks=" in text and "larger batch" in text
    assert re.search(why, text), text
    assert said[0].filename == __file__  # points at the user's call


def test_the_batch_s_own_size_decides_not_the_setting() -> None:
    # split_size=8 gives one micro-batch of 8 rows, two of a 16-row batch.
    pipe = two_stages(split_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SingleMicroBatchWarning)
        train_step(pipe, *batch(16))
    with pytest.warns(SingleMicroBatchWarning, match="batch of 5 rows"):
        train_step(pipe, *batch(5))
    with pytest.warns(SingleMicroBatchWarning, match="chunks=4, but the batch has one row"):
        train_step(two_stages(chunks=4), *batch(1))


@pytest.mark.parametrize(
    "case", ["one stage", "no gradients", "several micro-batches", "a tuning curve"]
)
def test_nothing_is_said_where_overlap_is_not_lost(case: str) -> None:
    x, y = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SingleMicroBatchWarning)
        if case == "one stage":
            train_step(Pipe(mlp([6, 8, 4]), chunks=1, balance=[4], devices=["cpu"]), x, y)
        elif case == "no gradients":
            with torch.no_grad():
                two_stages(chunks=1)(x)
        elif case == "several micro-batches":
            user_loop(two_stages(chunks=2), x, y)
        else:
            mpstream.tune(
                two_stages(), x, nn.MSELoss(), [4, 8], target=y, repeat=1, cache=None,
                progress=False,
            )  # fmt: skip


def test_a_tuning_curve_s_try_leaves_the_warning_to_the_user_s_own_call() -> None:
    x, y = batch()
    pipe = two_stages(split_size=8)
    mpstream.tune(
        pipe, x, nn.MSELoss(), [8, 4], target=y, repeat=1, cache=None, progress=False
    )  # its first point runs this pipe as one micro-batch, silently
    pipe.split_size = 8
    with pytest.warns(SingleMicroBatchWarning, match="split_size=8 >= the batch's 8 rows"):
        train_step(pipe, x, y)

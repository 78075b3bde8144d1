"""A call with gradients that runs its batch through several stages as one
micro-batch cannot overlap them: the pipe says so once, with why and what
to do; not on every step, not for one stage, not without gradients, not
for the points of a tuning curve."""

from __future__ import annotations

import inspect
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import mpstream
from mpstream import CapturedStep, Pipe, SingleMicroBatchWarning
from mpstream import distributed as mpdist
from tests.helpers import mlp


def two_stages(**kwargs: object) -> Pipe:
    return Pipe(mlp([6, 8, 4]), balance=[2, 2], devices=["cpu", "cpu"], **kwargs)  # type: ignore[arg-type]


def batch(rows: int = 8) -> tuple[Tensor, Tensor]:
    return torch.randn(rows, 6, dtype=torch.float64), torch.randn(rows, 4, dtype=torch.float64)


def user_loop(pipe: Pipe, x: Tensor, y: Tensor) -> None:
    nn.functional.mse_loss(pipe(x), y).backward()


def train_step(pipe: Pipe, x: Tensor, y: Tensor) -> None:
    pipe.train_step(x, y, nn.MSELoss())


def captured_step(pipe: Pipe, x: Tensor, y: Tensor) -> None:
    step = CapturedStep(pipe, x, y, nn.MSELoss())
    step(x, y)  # on the CPU, the first call runs the step


def distributed_train_step(pipe: Pipe, x: Tensor, y: Tensor) -> None:
    with one_process_group():
        ddp = mpdist.wrap(pipe)
        mpdist.train_step(ddp, x, y, nn.MSELoss())


@contextmanager
def one_process_group() -> Iterator[None]:
    """A one-process gloo group on an in-memory store, loopback only."""
    if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


RUNS = {"loop": user_loop, "train_step": train_step}
ENTRY_POINTS: dict[str, Callable[[Pipe, Tensor, Tensor], None]] = {
    **RUNS,
    "CapturedStep": captured_step,
    "distributed.train_step": distributed_train_step,
}


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


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_the_warning_points_at_the_user_s_line_in_every_entry_point(entry: str) -> None:
    run = ENTRY_POINTS[entry]
    lines, first = inspect.getsourcelines(run)
    call = first + len(lines) - 1  # each entry point's public call is its last line
    x, y = batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SingleMicroBatchWarning)  # pyproject ignores it
        run(two_stages(chunks=1), x, y)
    said = [w for w in caught if issubclass(w.category, SingleMicroBatchWarning)]
    assert len(said) == 1
    assert (said[0].filename, said[0].lineno) == (__file__, call)


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


class Scaled(nn.Module):
    """A first stage taking a whole (NoChunk) scale before the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8, dtype=torch.float64)

    def forward(self, scale: Tensor, x: Tensor) -> Tensor:
        return self.lin(x) * scale.sum()


def test_the_rows_said_are_the_batch_s_not_a_nochunk_tensor_s() -> None:
    # The scale (3 rows, given whole) comes first: the batch has 8 rows.
    pipe = Pipe(
        nn.Sequential(Scaled(), nn.Linear(8, 4, dtype=torch.float64)),
        chunks=1,
        balance=[1, 1],
        devices=["cpu", "cpu"],
    )
    x, y = batch(8)
    scale = mpstream.NoChunk(torch.ones(3, dtype=torch.float64))
    with pytest.warns(SingleMicroBatchWarning, match="batch of 8 rows"):
        pipe.train_step((scale, x), y, nn.MSELoss())

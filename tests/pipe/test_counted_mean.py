"""train_step with an nn.CrossEntropyLoss / nn.NLLLoss averaging over the
targets it keeps (pipe/reduction.py's counted mean): the targets the plain
loss takes, and its errors, reach the pipe's loss the same way."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.pipe.reduction import counted_mean
from tests.helpers import assert_same_grads, mlp, virtual_for

BATCH = 10
LABELS = [0, 0, 0, 0, 1, 2, 2, 1, 0, 2]


def pipe_of(model: nn.Module, schedule: str = "1f1b") -> Pipe:
    stages = 4 if virtual_for(schedule, 4) else 2
    return Pipe(
        copy.deepcopy(model),
        split_size=4,  # 4 + 4 + 2: a last micro-batch of its own size
        balance=[len(model) // stages] * stages,
        devices=["cpu"] * stages,
        schedule=schedule,
        virtual_stages=virtual_for(schedule, stages),
    )


def assert_step_matches(
    pipe: Pipe, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module
) -> None:
    """One train_step's loss and gradients equal the plain model's."""
    loss = pipe.train_step(x, y, loss_fn)
    expected = loss_fn(model(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, model)


@pytest.mark.parametrize("ignore_index", [-100, 0])
def test_byte_class_indices_count_as_classes_not_as_a_mask(ignore_index: int) -> None:
    # The plain loss takes uint8 targets as class indices; indexing the class
    # weights with them would select by a mask instead.
    torch.manual_seed(0)
    model = mlp([4, 8, 3])
    pipe = pipe_of(model)
    loss_fn = nn.CrossEntropyLoss(
        weight=torch.rand(3, dtype=torch.float64), ignore_index=ignore_index
    )
    x, y = torch.randn(BATCH, 4, dtype=torch.float64), torch.tensor(LABELS, dtype=torch.uint8)
    assert_step_matches(pipe, model, x, y, loss_fn)


def test_a_class_out_of_range_is_the_losss_own_error_and_undone() -> None:
    # Counting the class weights must not raise first, with an indexing
    # error that names no target: the loss names it, on its micro-batch.
    torch.manual_seed(0)
    model = mlp([4, 8, 3])
    pipe = pipe_of(model)
    loss_fn = nn.CrossEntropyLoss(weight=torch.rand(3, dtype=torch.float64))
    x, y = torch.randn(BATCH, 4, dtype=torch.float64), torch.tensor(LABELS)
    bad = y.clone()
    bad[9] = 7
    with pytest.raises(IndexError, match="Target 7 is out of bounds") as info:
        pipe.train_step(x, bad, loss_fn)
    assert "loss_fn on micro-batch 2 (of 3)" in "\n".join(info.value.__notes__)
    assert all(p.grad is None for p in pipe.parameters())
    assert_step_matches(pipe, model, x, y, loss_fn)  # and the next step runs


@pytest.mark.parametrize("schedule", ["gpipe", "zb_h1", "zbv", "dualpipev"])
def test_per_pixel_targets_count_over_the_whole_batch(schedule: str) -> None:
    # Segmentation: logits (N, C, H, W), labels (N, H, W) with pixels and
    # whole micro-batches ignored; split and V schedules, a short last one.
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in [(2, 4), (4, 4), (4, 4), (4, 3)]:
        layers += [nn.Conv2d(a, b, 1), nn.Tanh()]
    model = nn.Sequential(*layers).double()
    pipe = pipe_of(model, schedule)
    loss_fn = nn.CrossEntropyLoss(
        weight=torch.rand(3, dtype=torch.float64), ignore_index=-100, label_smoothing=0.1
    )
    x = torch.randn(BATCH, 2, 3, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (BATCH, 3, 3))
    y[:4] = -100
    y[6, 1] = -100
    assert_step_matches(pipe, model, x, y, loss_fn)


def test_the_count_leaves_the_class_weights_where_they_are() -> None:
    # Weights on a GPU and targets on the host: copying the weights to the
    # targets' device would block the host every step. A meta tensor has no
    # data to copy: the count must not read it.
    labels = torch.tensor(LABELS)
    loss_fn = nn.CrossEntropyLoss(weight=torch.rand(3, device="meta"), ignore_index=0)
    _, reduction, (target, count) = counted_mean(loss_fn, "mean", labels)
    assert reduction == "sum" and target is labels
    assert count.tensor.tolist() == [0, 2, 3]  # kept targets per class


def test_a_float16_batch_whose_sum_overflows_keeps_its_mean() -> None:
    # The micro-batches' sums are taken wider than float16: 10000 rows of
    # loss ~9 add up past float16's 65504, their mean does not.
    torch.manual_seed(0)
    logits = 8 * torch.randn(10000, 5).half()
    labels = torch.randint(0, 5, (10000,))
    loss_fn = nn.CrossEntropyLoss(ignore_index=0)
    summed, _, (target, count) = counted_mean(loss_fn, "mean", labels)
    got = summed(logits, (target, count.tensor))
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), loss_fn(logits.float(), labels), rtol=1e-3, atol=0)

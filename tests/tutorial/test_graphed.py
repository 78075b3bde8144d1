"""The tutorial's pipeline trained through CapturedStep: the tutorial's loop
gives the same parameters as mpstream's eager pipeline, with one captured
step per batch shape.

Training ResNet50 on random data at these sizes is chaotic: a rounding
difference in one step (summing micro-batch gradients in another order)
grows about a hundredfold per step. Comparisons over several steps with
uneven micro-batches therefore run in float64.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from mpstream.tutorial import StreamPipelineResNet50, train
from mpstream.tutorial.graphed import GraphedPipelineResNet50


def _pair(
    device: str, split: int, dtype: torch.dtype = torch.float32
) -> tuple[GraphedPipelineResNet50, StreamPipelineResNet50]:
    torch.manual_seed(0)
    graphed = GraphedPipelineResNet50(device, device, split_size=split, num_classes=10).to(dtype)
    torch.manual_seed(0)
    eager = StreamPipelineResNet50(device, device, split_size=split, num_classes=10).to(dtype)
    return graphed, eager


def _assert_same(graphed: nn.Module, eager: nn.Module) -> None:
    for (name, a), b in zip(graphed.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def _steps_in_float64(
    graphed: GraphedPipelineResNet50,
    eager: StreamPipelineResNet50,
    batches: list[int],
    device: str,
) -> None:
    """The tutorial's step (MSELoss, SGD at lr 0.001) on both, one per batch size."""
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.001)
    g = torch.Generator().manual_seed(1)
    for batch in batches:
        x = torch.randn(batch, 3, 64, 64, dtype=torch.float64, generator=g).to(device)
        y = torch.randn(batch, 10, dtype=torch.float64, generator=g).to(device)
        loss = graphed.fit_batch(x, y, nn.MSELoss(), 0.001)
        optimizer.zero_grad()
        expected = nn.MSELoss()(eager(x), y)
        expected.backward()
        optimizer.step()
        torch.testing.assert_close(loss, expected.detach())


def test_the_tutorial_loop_hands_each_batch_to_one_captured_step() -> None:
    graphed, eager = _pair("cpu", 4)
    for model in (graphed, eager):
        torch.manual_seed(1)  # the same random batches for both
        train(model, num_batches=2, batch_size=8, image_w=64, image_h=64, num_classes=10)
    _assert_same(graphed, eager)  # two even micro-batches: the same sums, bit for bit
    steps = graphed.__dict__["_steps"]
    assert len(steps) == 1 and not next(iter(steps.values())).captured
    train(graphed, num_batches=1, batch_size=8, image_w=64, image_h=64, num_classes=10)
    assert len(steps) == 1  # a new nn.MSELoss() per call: the same step
    twin = copy.deepcopy(graphed)  # the copy captures its own steps
    assert twin.__dict__["_steps"] == {} and len(graphed.__dict__["_steps"]) == 1
    train(twin, num_batches=1, batch_size=8, image_w=64, image_h=64, num_classes=10)
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(next(iter(steps.values())))
    graphed.split_size = 5  # a graph keeps its micro-batching: a new step
    train(graphed, num_batches=1, batch_size=8, image_w=64, image_h=64, num_classes=10)
    assert len(steps) == 2 and graphed.__dict__["pipe"].split_size == 5


def test_a_new_loss_function_object_per_call_is_warned_once() -> None:
    graphed, _ = _pair("cpu", 2)
    x, y = torch.randn(4, 3, 32, 32), torch.randn(4, 10)  # two micro-batches: no other warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graphed.fit_batch(x, y, nn.MSELoss(), 0.001)
        graphed.fit_batch(x, y, nn.L1Loss(), 0.001)  # another loss, deliberately
    with pytest.warns(UserWarning, match=r"loss function object changed \(.*<lambda>\)"):
        graphed.fit_batch(x, y, lambda out, t: nn.functional.mse_loss(out, t), 0.001)
        graphed.fit_batch(x, y, lambda out, t: nn.functional.mse_loss(out, t), 0.001)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model
        graphed.fit_batch(x, y, lambda out, t: nn.functional.mse_loss(out, t), 0.001)
    assert len(graphed.__dict__["_steps"]) == 5  # each object its own step, as warned


def test_steps_equal_the_eager_pipeline_in_float64() -> None:
    graphed, eager = _pair("cpu", 3, torch.float64)
    _steps_in_float64(graphed, eager, [9, 8], "cpu")  # 3 micro-batches of 3, then 3, 3, 2
    assert len(graphed.__dict__["_steps"]) == 2  # one per batch shape
    _assert_same(graphed, eager)


@pytest.mark.cuda
def test_on_one_gpu_each_step_is_a_replayed_graph_and_trains_alike() -> None:
    graphed, eager = _pair("cuda:0", 3, torch.float64)
    _steps_in_float64(graphed, eager, [10, 10, 10], "cuda:0")
    (step,) = graphed.__dict__["_steps"].values()
    assert step.captured
    _assert_same(graphed, eager)

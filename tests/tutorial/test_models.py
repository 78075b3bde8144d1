"""ResNet50 through mpstream equals the single-device model (CPU, float64)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torchvision.models import resnet50

from mpstream import Pipe
from mpstream.tutorial import (
    ModelParallelResNet50,
    PipelineParallelResNet50,
    StreamPipelineResNet50,
    resnet50_layers,
    single_device_resnet50,
    train,
)
from tests.helpers import assert_same_grads

BATCH = 8
CLASSES = 10


def images() -> Tensor:
    return torch.randn(BATCH, 3, 64, 64, dtype=torch.float64)


def loss(out: Tensor) -> Tensor:
    return (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()


def reference_like(model: ModelParallelResNet50) -> nn.Module:
    ref = resnet50(num_classes=CLASSES).double()
    ref.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("seq")})
    return ref


def compare_grads(model: nn.Module, ref: nn.Module) -> None:
    mine = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(mine[name].grad, p.grad, msg=name)


@pytest.mark.parametrize("split_size", [3, 8, 20])
def test_stream_pipeline_resnet50_train_mode(split_size: int) -> None:
    model = StreamPipelineResNet50(
        "cpu", "cpu", split_size=split_size, num_classes=CLASSES
    ).double()
    ref = reference_like(model)
    x = images()
    out = model(x)
    loss(out).backward()
    # BatchNorm normalises each micro-batch on its own: the reference runs the
    # same micro-batches and back-propagates once through their concatenation.
    expected = torch.cat([ref(part) for part in x.split(split_size)])
    loss(expected).backward()
    torch.testing.assert_close(out, expected)
    compare_grads(model, ref)
    mine = dict(model.named_buffers())
    for name, buf in ref.named_buffers():
        torch.testing.assert_close(mine[name], buf, msg=name)


def test_stream_pipeline_resnet50_eval_mode() -> None:
    model = StreamPipelineResNet50("cpu", "cpu", split_size=3, num_classes=CLASSES).double().eval()
    ref = reference_like(model).eval()
    x = images()
    out = model(x)
    expected = ref(x)
    torch.testing.assert_close(out, expected)
    loss(out).backward()
    loss(expected).backward()
    compare_grads(model, ref)


@pytest.mark.parametrize(
    ("balance", "split_size"), [([11, 12], 3), ([6, 6, 6, 5], 5), ([4, 8, 11], 7)]
)
def test_pipe_over_resnet50_blocks(balance: list[int], split_size: int) -> None:
    ref = resnet50(num_classes=CLASSES).double().eval()
    pipe = Pipe(
        resnet50_layers(copy.deepcopy(ref)),
        split_size=split_size,
        balance=balance,
        devices=["cpu"] * len(balance),
    ).eval()
    x = images()
    out = pipe(x)
    expected = ref(x)
    torch.testing.assert_close(out, expected)
    loss(out).backward()
    loss(expected).backward()
    assert_same_grads(pipe, ref)


def test_resnet50_layers_shares_modules_and_matches_forward() -> None:
    ref = resnet50(num_classes=CLASSES).eval()
    flat = resnet50_layers(ref)
    assert len(flat) == 23
    assert flat.conv1 is ref.conv1 and flat.layer3_4 is ref.layer3[4]
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(flat(x), ref(x))


def test_tutorial_models_share_weights_and_agree() -> None:
    mp = ModelParallelResNet50("cpu", "cpu", num_classes=CLASSES).eval()
    pp = PipelineParallelResNet50("cpu", "cpu", split_size=3, num_classes=CLASSES).eval()
    sp = StreamPipelineResNet50("cpu", "cpu", split_size=3, num_classes=CLASSES).eval()
    pp.load_state_dict(mp.state_dict())
    sp.load_state_dict(mp.state_dict())
    assert list(sp.state_dict()) == list(mp.state_dict())
    x = torch.randn(5, 3, 64, 64)
    with torch.no_grad():
        expected = mp(x)
        torch.testing.assert_close(pp(x), expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(sp(x), expected, rtol=1e-4, atol=1e-5)
    sp.split_size = 2
    assert sp.split_size == 2


def test_train_loop_runs_every_model() -> None:
    for model in (
        resnet50(num_classes=CLASSES),
        ModelParallelResNet50("cpu", "cpu", num_classes=CLASSES),
        PipelineParallelResNet50("cpu", "cpu", split_size=2, num_classes=CLASSES),
        StreamPipelineResNet50("cpu", "cpu", split_size=2, num_classes=CLASSES),
    ):
        before = [p.detach().clone() for p in model.parameters()]
        last = train(
            model, num_batches=2, batch_size=4, image_w=32, image_h=32, num_classes=CLASSES
        )
        assert torch.isfinite(last)
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_stream_pipeline_resnet50_refuses_a_device_move_and_follows_its_mode() -> None:
    # The pipe sits outside _modules (state_dict keys): the model hands it
    # what a module call would have reached it through its children.
    sp = StreamPipelineResNet50("cpu", "cpu", split_size=3, num_classes=CLASSES)
    with pytest.raises(TypeError, match="would move the stages on cpu to meta"):
        sp.to("meta")
    assert {p.device.type for p in sp.parameters()} == {"cpu"}  # nothing moved
    sp.eval()
    assert not sp.__dict__["pipe"].training
    sp.train()
    assert sp.__dict__["pipe"].training
    sp.double()
    assert {p.dtype for p in sp.parameters()} == {torch.float64}


@pytest.mark.parametrize(
    "make",
    [
        lambda dev: ModelParallelResNet50("cpu", dev),
        lambda dev: PipelineParallelResNet50(dev, "cpu", split_size=4),
        lambda dev: StreamPipelineResNet50("cpu", dev, split_size=4),
        lambda dev: single_device_resnet50(dev),
    ],
    ids=["model_parallel", "pipeline_parallel", "stream_pipeline", "single_device"],
)
def test_a_device_this_machine_lacks_is_named_before_anything_moves(make: Any) -> None:
    # The tutorial's cuda:0 and cuda:1 copied onto a machine with fewer GPUs:
    # the argument named, not torch's driver error from deep inside .to().
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=rf"(dev[01]|device) is {missing}, but .* here; available"):
        make(missing)

"""torchvision's classification families, split at their own submodules'
names: outputs, gradients and running statistics equal the plain model's in
eval and training mode (aux heads' namedtuples, concatenations across
blocks, class tokens, shifted windows, channel shuffles, stochastic depth),
with deferred BatchNorm and emulated graphed stages on some. Tiny configs of
each family's own classes: one model per family that is built differently
(every torchvision model was swept once, by a script outside the suite)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated

tv = pytest.importorskip("torchvision")
CNBlockConfig = tv.models.convnext.CNBlockConfig

BATCH, CLASSES = 6, 5


def googlenet() -> nn.Module:
    return tv.models.googlenet(num_classes=CLASSES, aux_logits=True, init_weights=True)


def densenet() -> nn.Module:
    return tv.models.DenseNet(8, (2, 2), 8, bn_size=2, num_classes=CLASSES)


def vit() -> nn.Module:
    return tv.models.VisionTransformer(32, 16, 3, 2, 8, 16, num_classes=CLASSES)


def swin() -> nn.Module:
    return tv.models.SwinTransformer([4, 4], 8, [2, 2], [1, 2], [2, 2], num_classes=CLASSES)


def maxvit() -> nn.Module:
    return tv.models.MaxVit((32, 32), 8, 2, [8, 16], [1, 1], 4, 0.2, num_classes=CLASSES)


def convnext() -> nn.Module:
    blocks = [CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 2)]
    return tv.models.ConvNeXt(blocks, stochastic_depth_prob=0.5, num_classes=CLASSES)


def shufflenet() -> nn.Module:
    return tv.models.ShuffleNetV2([1, 1, 1], [8, 8, 16, 32, 64], num_classes=CLASSES)


def mobilenet() -> nn.Module:
    return tv.models.mobilenet_v3_small(width_mult=0.25, num_classes=CLASSES)


# name: (model, image size, split points)
FAMILIES: dict[str, tuple[Callable[[], nn.Module], int, list[str]]] = {
    "googlenet": (googlenet, 32, ["inception3b", "inception4e"]),
    "densenet": (densenet, 32, ["features.transition1"]),
    "vit": (vit, 32, ["encoder.layers.encoder_layer_1", "encoder.ln"]),
    "swin": (swin, 32, ["features.2", "norm"]),
    "maxvit": (maxvit, 32, ["blocks.1"]),
    "convnext": (convnext, 32, ["features.2", "features.3"]),
    "shufflenet": (shufflenet, 32, ["stage3"]),
    "mobilenet": (mobilenet, 32, ["features.4", "classifier"]),
}


def build(name: str) -> tuple[nn.Module, Tensor, list[str]]:
    make, size, points = FAMILIES[name]
    torch.manual_seed(0)
    model = make().double()
    return model, torch.randn(BATCH, 3, size, size, dtype=torch.float64), points


def without_randomness(model: nn.Module) -> nn.Module:
    """Dropout and stochastic depth off: training runs comparable per micro-batch."""
    for m in model.modules():
        if isinstance(m, (nn.Dropout, tv.ops.StochasticDepth)):
            m.p = 0.0
    return model


def pipe_of(model: nn.Module, points: list[str], **kw: Any) -> Pipe:
    return Pipe(model, split_points=points, devices=["cpu"] * (len(points) + 1), **kw)


def loss_fn(out: Any, target: Tensor) -> Tensor:
    outs = out if isinstance(out, tuple) else (out,)
    return sum(
        (nn.functional.mse_loss(o, target) for o in outs), torch.zeros((), dtype=target.dtype)
    )


def assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    """As tests.helpers' but a parameter the call did not use (GoogLeNet's
    aux heads in eval mode) may have no gradient, in both."""
    pa, pb = list(a.named_parameters()), list(b.named_parameters())
    assert [n for n, _ in pa] == [n for n, _ in pb]
    for (name, x), (_, y) in zip(pa, pb):
        if y.grad is None:
            assert x.grad is None, f"{name} has a gradient, the plain model's none"
        else:
            torch.testing.assert_close(x.grad, y.grad, msg=f"grad of {name}")


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sb:
        torch.testing.assert_close(sa[key], sb[key], msg=key)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_eval_mode_matches_the_plain_model(name: str) -> None:
    model, x, points = build(name)
    model.eval()
    pipe = pipe_of(copy.deepcopy(model), points, split_size=4)  # 4 + 2
    out, expected = pipe(x), model(x)
    torch.testing.assert_close(out, expected)
    out.pow(2).mean().backward()
    expected.pow(2).mean().backward()
    assert_same_grads(pipe, model)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_training_steps_match_the_plain_model_per_micro_batch(name: str) -> None:
    # BatchNorm normalises each micro-batch on its own: the reference runs them
    # one by one, and its running statistics advance once per micro-batch too.
    model, x, points = build(name)
    model = without_randomness(model).train()
    target = torch.randn(BATCH, CLASSES, dtype=torch.float64)
    pipe = pipe_of(copy.deepcopy(model), points, chunks=2, schedule="1f1b", checkpoint="always")
    loss = pipe.train_step(x, target, loss_fn)
    expected = sum(
        (loss_fn(model(xs), ts) / 2 for xs, ts in zip(x.chunk(2), target.chunk(2))),
        torch.zeros((), dtype=torch.float64),
    )
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, model)
    assert_same_state(pipe, model)


def test_googlenet_s_aux_outputs_come_back_as_its_namedtuple() -> None:
    model, x, points = build("googlenet")
    model = without_randomness(model).train()
    pipe = pipe_of(copy.deepcopy(model), points, split_size=3)
    out = pipe(x)
    expected = [model(part) for part in x.split(3)]
    assert type(out).__name__ == "GoogLeNetOutputs"
    for i, field in enumerate(out):
        torch.testing.assert_close(field, torch.cat([e[i] for e in expected]))


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_stochastic_depth_draws_as_the_plain_model(checkpoint: str) -> None:
    # One micro-batch runs the stages in the plain model's order, so the same
    # seed draws the same masks; recomputation replays them.
    model, x, points = build("convnext")
    pipe = pipe_of(copy.deepcopy(model).train(), points, checkpoint=checkpoint)
    torch.manual_seed(3)
    out = pipe(x)
    torch.manual_seed(3)
    expected = model.train()(x)
    torch.testing.assert_close(out, expected)
    out.pow(2).mean().backward()
    expected.pow(2).mean().backward()
    assert_same_grads(pipe, model)


def test_deferred_batch_norm_keeps_the_whole_batch_s_statistics() -> None:
    model, x, points = build("densenet")
    model.train()
    pipe = pipe_of(copy.deepcopy(model), points, chunks=2, deferred_batch_norm=True)
    target = torch.randn(BATCH, CLASSES, dtype=torch.float64)
    pipe.train_step(x, target, loss_fn)
    # Each norm's statistics over what every micro-batch fed it, at once.
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    fed: dict[nn.Module, list[Tensor]] = {m: [] for m in norms}
    fresh = {m: copy.deepcopy(m) for m in norms}
    hooks = [m.register_forward_pre_hook(lambda m, a: fed[m].append(a[0])) for m in norms]
    for xs, ts in zip(x.chunk(2), target.chunk(2)):
        (loss_fn(model(xs), ts) / 2).backward()
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        for m in norms:
            fresh[m](torch.cat(fed[m]))
            m.load_state_dict(fresh[m].state_dict())
    assert_same_grads(pipe, model)
    assert_same_state(pipe, model)


@pytest.mark.parametrize("name", ["vit", "shufflenet"])
def test_emulated_graphed_stages_match_the_plain_model(name: str) -> None:
    model, x, points = build(name)
    model = without_randomness(model).train()
    target = torch.randn(BATCH, CLASSES, dtype=torch.float64)
    pipe = pipe_of(copy.deepcopy(model), points, chunks=2, schedule="1f1b", graphs=Emulated())
    pipe.train_step(x, target, loss_fn)
    report = pipe.graph_report()
    assert all(s.graphed for s in report.stages) and report.replays > 0, report
    for xs, ts in zip(x.chunk(2), target.chunk(2)):
        (loss_fn(model(xs), ts) / 2).backward()
    assert_same_grads(pipe, model)
    assert_same_state(pipe, model)


def test_balance_splits_vit_among_its_encoder_blocks() -> None:
    model, x, _ = build("vit")
    pipe = Pipe(copy.deepcopy(model).eval(), balance="size", sample=x[:2], devices=["cpu"] * 3)
    assert all(p.startswith("encoder.layers.") for p in pipe.split_points[1:])
    torch.testing.assert_close(pipe(x), model.eval()(x))

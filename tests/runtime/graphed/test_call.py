"""A graphed call's backward split in two: B replays the input gradients,
W the parameter gradients, later, as the zero-bubble schedules ask.

The :class:`~mpstream.runtime.graphed.backends.Emulated` backend runs the same split
analysis a CUDA capture runs, so what B and W compute is checked here on
the CPU; test_stages_cuda.py replays the real graphs."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode
from torchvision.models.resnet import Bottleneck

from mpstream.runtime.boundary import GradSink, cut
from mpstream.runtime.graphed.backends import Emulated
from mpstream.runtime.graphed.call import Backend, GraphedCall
from mpstream.runtime.split_backward import backward_inputs
from tests.helpers import assert_same_grads, mlp
from tests.runtime.test_split_backward import Hooked


def graphed(stage: nn.Module, x: Tensor, split: bool = True) -> GraphedCall:
    return GraphedCall(stage, (x,), stage, x.device, True, Emulated(), split=split)


def plain(stage: nn.Module, x: Tensor, grad: Tensor) -> Tensor | None:
    """The eager backward's input gradient (and parameter gradients)."""
    x = x.detach().requires_grad_()
    torch.autograd.backward([stage(x)], [grad])
    return x.grad


def bottlenecks() -> nn.Module:
    down = nn.Sequential(nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16))
    return nn.Sequential(Bottleneck(8, 4, downsample=down), Bottleneck(16, 4)).double()


#: Stages whose split backward is checked, and an input's shape.
SPLIT_STAGES = {
    "mlp": (lambda: mlp([5, 8, 7, 3]), (4, 5)),
    "resnet": (bottlenecks, (2, 8, 6, 6)),
    "hooked": (lambda: Hooked().double(), (3, 4)),
}


def check_split(stage: nn.Module, x: Tensor, backend: Backend, steps: int = 2) -> None:
    """B gives the input gradients, W the parameters' later: both equal a
    plain backward's, replay after replay (test_stages_cuda.py runs it on
    CUDA graphs)."""
    reference = copy.deepcopy(stage)
    example = cut(GradSink(), (x,))[0]
    call = GraphedCall(stage, (example,), stage, x.device, True, backend, split=True)
    assert call.passes == ("forward", "backward", "weight")
    for _ in range(steps):  # later passes replay into the same buffers
        stage.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        sink = GradSink()
        out = call(cut(sink, (x,))[0])
        grad = torch.randn_like(out)
        weight = backward_inputs([out], [grad])
        expected = plain(reference, x, grad)
        assert sink.grads is not None
        torch.testing.assert_close(sink.grads[0], expected)
        matrices = [n for n, p in stage.named_parameters() if p.dim() > 1]
        assert matrices and all(dict(stage.named_parameters())[n].grad is None for n in matrices)
        assert call.busy(), "the slot holds W's activations"
        weight.run()
        assert not call.busy()
        assert_same_grads(stage, reference)


@pytest.mark.parametrize("name", SPLIT_STAGES)
def test_b_gives_the_input_gradients_and_w_the_weights_later(name: str) -> None:
    torch.manual_seed(0)
    make, shape = SPLIT_STAGES[name]
    check_split(make(), torch.randn(*shape, dtype=torch.float64), Emulated())


def test_b_and_w_of_a_graphed_stage_do_the_work_of_one_backward() -> None:
    """Counted, not timed: B's matmuls are the input path's, W's the
    weights'; together those of the unsplit replayed backward."""
    stage = mlp([64, 128, 128, 32], torch.float32)
    x = torch.randn(16, 64)

    def count(split: bool) -> tuple[int, int]:
        call = graphed(stage, cut(GradSink(), (x,))[0], split)
        out = call(cut(GradSink(), (x,))[0])
        with FlopCounterMode(display=False) as first:
            weight = backward_inputs([out], [torch.ones_like(out)])
        with FlopCounterMode(display=False) as second:
            weight.run()
        return first.get_total_flops(), second.get_total_flops()

    whole, nothing = count(split=False)
    b, w = count(split=True)
    assert nothing == 0 and b > 0 and w > 0
    assert b + w == whole


def test_a_plain_backward_through_a_split_call_runs_both_passes() -> None:
    stage = mlp([5, 8, 3])
    reference = copy.deepcopy(stage)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    call = graphed(stage, x)
    out = call(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    torch.testing.assert_close(x.grad, plain(reference, x, grad))
    assert_same_grads(stage, reference)
    assert not call.busy()


def test_a_first_stage_leaves_everything_to_w() -> None:
    stage = mlp([5, 8, 3])
    reference = copy.deepcopy(stage)
    x = torch.randn(4, 5, dtype=torch.float64)
    call = graphed(stage, x)
    assert call.passes == ("forward", "weight")
    out = call(x)
    grad = torch.randn_like(out)
    weight = backward_inputs([out], [grad])
    assert all(p.grad is None for p in stage.parameters())
    weight.run()
    plain(reference, x, grad)
    assert_same_grads(stage, reference)


def test_a_forward_replayed_between_b_and_w_is_refused() -> None:
    stage = mlp([5, 8, 3])
    x = torch.randn(4, 5, dtype=torch.float64)
    call = graphed(stage, cut(GradSink(), (x,))[0])
    out = call(cut(GradSink(), (x,))[0])
    weight = backward_inputs([out], [torch.ones_like(out)])
    call(cut(GradSink(), (x,))[0])  # overwrites the slot W still reads
    with pytest.raises(RuntimeError, match="between this backward's input and weight passes"):
        weight.run()


class Unused(nn.Module):
    """A second input that needs a gradient the stage never gives it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor, unused: Tensor) -> Tensor:
        return self.lin(x) + unused.detach()


def test_an_input_the_outputs_do_not_reach_gets_no_gradient() -> None:
    stage = Unused().double()
    reference = copy.deepcopy(stage)
    x, unused = (torch.randn(3, 4, dtype=torch.float64) for _ in range(2))
    call = GraphedCall(
        stage, (x, unused.requires_grad_()), stage, x.device, True, Emulated(), split=True
    )
    assert call.passes == ("forward", "weight")
    out = call(x, unused)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert unused.grad is None
    reference(x, unused).backward(grad)
    assert_same_grads(stage, reference)


def test_a_call_keeps_neither_its_example_nor_its_captured_outputs() -> None:
    # Only the static buffers are the call's: the example's tensors and what
    # capture returned (with its autograd graph) go once capture is done.
    stage = mlp([5, 8, 3])
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    captured: list[weakref.ref[Tensor]] = []

    def fn(a: Tensor, scale: float) -> tuple[Tensor, str]:
        out = stage(a) * scale
        captured.append(weakref.ref(out))
        return out, "label"

    call = GraphedCall(fn, (x, 2.0), stage, x.device, True, Emulated())
    example = weakref.ref(x)
    del x
    gc.collect()
    assert example() is None and captured and all(r() is None for r in captured)
    y = torch.randn(4, 5, dtype=torch.float64)
    out, label = call(y, 2.0)
    torch.testing.assert_close(out, stage(y) * 2.0)
    assert label == "label"

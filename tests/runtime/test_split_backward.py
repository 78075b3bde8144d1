"""Split backwards: B (input gradients) then W (parameter gradients) give
exactly a plain backward's gradients, with the work of one backward."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode
from torchvision.models.resnet import Bottleneck

from mpstream.memory import SavedTensorTracker
from mpstream.runtime.boundary import GradSink, cut
from mpstream.runtime.split_backward import backward_inputs
from tests.helpers import mlp
from tests.models import Fan


class TwiceInARow(nn.Module):
    """One weight used by two layers one after the other."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.other = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(torch.tanh(self.other(torch.tanh(self.lin(x)))))


class TwoBranches(nn.Module):
    """One weight used on two parallel branches; an output of parameters only."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.lin(x) * self.lin(torch.sin(x)), self.bias * 2


def run(stage: nn.Module, x: Tensor, split: bool, cut_input: bool = True) -> list[Tensor | None]:
    """One backward of ``stage`` from random output gradients; returns the
    input gradients that reached the cut."""
    sink = GradSink()
    inp = cut(sink, (x,))[0] if cut_input else x
    out = stage(inp)
    outs = list(out) if isinstance(out, tuple) else [out]
    torch.manual_seed(3)
    grads = [torch.randn_like(o) for o in outs]
    if split:
        weight = backward_inputs(outs, grads)
        weight.run()
    else:
        torch.autograd.backward(outs, grads)
    return list(sink.grads or ())


def compare(make: Callable[[], nn.Module], x: Tensor, cut_input: bool = True) -> None:
    torch.manual_seed(0)
    plain = make()
    split = copy.deepcopy(plain)
    expected = run(plain, x, False, cut_input)
    got = run(split, x, True, cut_input)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    for (name, p), q in zip(plain.named_parameters(), split.parameters()):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def bottlenecks() -> nn.Module:
    down = nn.Sequential(nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16))
    return nn.Sequential(Bottleneck(8, 4, downsample=down), Bottleneck(16, 4)).double()


class Hooked(nn.Module):
    """A tensor hook on a layer's output, where W starts (a junction)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        h.register_hook(lambda g: g * 0.5)
        return self.b(torch.tanh(h))


class Reentrant(nn.Module):
    """A reentrant checkpoint inside a stage: its backward refuses ``inputs``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        inner = checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=True)
        return self.b(inner)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("name", "make", "shape"),
    [
        ("mlp", lambda: mlp([5, 8, 7, 3]), (4, 5)),
        ("resnet", bottlenecks, (2, 8, 6, 6)),
        ("fan", lambda: Fan().double(), (3, 4)),
        ("twice_in_a_row", lambda: TwiceInARow().double(), (3, 4)),
        ("two_branches", lambda: TwoBranches().double(), (3, 4)),
        ("hooked", lambda: Hooked().double(), (3, 4)),
        ("reentrant_checkpoint", lambda: Reentrant().double(), (3, 4)),
    ],
)
def test_b_then_w_equals_a_plain_backward(
    name: str, make: Callable[[], nn.Module], shape: tuple[int, ...]
) -> None:
    compare(make, torch.randn(*shape, dtype=torch.float64))


def test_a_first_stage_leaves_everything_to_w() -> None:
    torch.manual_seed(0)
    stage = mlp([5, 6, 3])
    out = stage(torch.randn(4, 5, dtype=torch.float64))
    weight = backward_inputs([out], [torch.ones_like(out)])
    assert all(p.grad is None for p in stage.parameters())
    weight.run()
    assert all(p.grad is not None for p in stage.parameters())
    compare(lambda: mlp([5, 6, 3]), torch.randn(4, 5, dtype=torch.float64), cut_input=False)


def test_b_computes_no_weight_gradient_and_w_no_input_gradient() -> None:
    torch.manual_seed(0)
    stage = mlp([5, 6, 3])
    sink = GradSink()
    out = stage(cut(sink, (torch.randn(4, 5, dtype=torch.float64),))[0])
    weight = backward_inputs([out], [torch.ones_like(out)])
    assert sink.grads is not None and sink.grads[0] is not None
    assert all(p.grad is None for p in stage.parameters())
    sink.grads = None
    weight.run()
    assert sink.grads is None
    # A weight used twice in a row is the exception: B computes it.
    twice = TwiceInARow().double()
    out = twice(cut(GradSink(), (torch.randn(2, 4, dtype=torch.float64),))[0])
    weight = backward_inputs([out], [torch.ones_like(out)])
    assert twice.lin.weight.grad is not None and twice.other.weight.grad is None
    weight.run()
    assert twice.other.weight.grad is not None


class Scale(torch.autograd.Function):
    """x * w, with a backward that computes both gradients whenever it runs."""

    calls = 0

    @staticmethod
    def forward(ctx: object, x: Tensor, w: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)  # type: ignore[attr-defined]
        return x * w

    @staticmethod
    def backward(ctx: object, g: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        Scale.calls += 1
        x, w = ctx.saved_tensors  # type: ignore[attr-defined]
        return g * w, (g * x).sum(0)


def test_a_custom_function_on_the_input_path_runs_once() -> None:
    w = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    lin = nn.Linear(3, 3).double()
    x = torch.randn(5, 3, dtype=torch.float64)

    def stage(inp: Tensor) -> Tensor:
        return Scale.apply(lin(inp), w[0])  # type: ignore[no-any-return]

    Scale.calls = 0
    out = stage(cut(GradSink(), (x,))[0])
    weight = backward_inputs([out], [torch.ones_like(out)])
    assert w.grad is not None and Scale.calls == 1, "B computes what the Function gives"
    assert lin.weight.grad is None
    weight.run()
    assert Scale.calls == 1 and lin.weight.grad is not None
    got = (w.grad.clone(), lin.weight.grad.clone())
    w.grad = lin.weight.grad = lin.bias.grad = None
    stage(x).sum().backward()
    torch.testing.assert_close(got[0], w.grad)
    torch.testing.assert_close(got[1], lin.weight.grad)


class Retained(nn.Module):
    """A retained gradient on a layer's output, where W starts (a junction)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.kept: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        h.retain_grad()
        h.register_hook(lambda g: g * 0.5)
        self.kept.append(h)
        out: Tensor = self.b(torch.tanh(h))
        return out


def test_a_retained_gradient_at_a_junction_is_not_counted_twice() -> None:
    """W restarts at the junction, where autograd runs the retain hook
    again: the retained ``.grad`` is the plain backward's, not double."""
    torch.manual_seed(0)
    plain = Retained().double()
    split = copy.deepcopy(plain)
    x = torch.randn(3, 4, dtype=torch.float64)
    run(plain, x, False)
    run(split, x, True)
    assert split.a.weight.grad is not None, "W ran"
    expected, got = plain.kept[0].grad, split.kept[0].grad
    assert expected is not None and got is not None
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(split.a.weight.grad, plain.a.weight.grad)


def flops(stage: nn.Module, x: Tensor, split: bool) -> tuple[int, int]:
    out = stage(cut(GradSink(), (x,))[0])
    grad = torch.ones_like(out)
    with FlopCounterMode(display=False) as first:
        weight = backward_inputs([out], [grad]) if split else None
        if weight is None:
            torch.autograd.backward([out], [grad])
    with FlopCounterMode(display=False) as second:
        if weight is not None:
            weight.run()
    return first.get_total_flops(), second.get_total_flops()


@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda: mlp([64, 128, 128, 32], torch.float32), (16, 64)),
        (lambda: bottlenecks().float(), (4, 8, 12, 12)),
    ],
)
def test_b_plus_w_do_the_work_of_one_backward(
    make: Callable[[], nn.Module], shape: tuple[int, ...]
) -> None:
    """Counted, not timed: the matmuls and convolutions of B and W add up to
    those of the plain backward; neither pass repeats the other's."""
    stage = make()
    x = torch.randn(*shape)
    plain, nothing = flops(stage, x, False)
    b, w = flops(stage, x, True)
    assert nothing == 0 and b > 0 and w > 0
    assert b + w == plain


def test_the_graph_is_freed_by_w() -> None:
    stage = mlp([5, 16, 16, 3])
    with SavedTensorTracker() as tracker:
        out = stage(cut(GradSink(), (torch.randn(8, 5, dtype=torch.float64),))[0])
    weight = backward_inputs([out], [torch.ones_like(out)])
    del out
    assert tracker.current_bytes > 0, "B keeps what W reads"
    weight.run()
    del weight
    assert tracker.current_bytes == 0

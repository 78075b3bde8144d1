"""One graphed call: its forward, its backward (whole, or split in two: B
replays the input gradients, W the parameter gradients, later, as the
zero-bubble schedules ask), parameter gradients added into the stage's
buffers, and what the call keeps.

The :class:`~mpstream.runtime.graphed.emulated.Emulated` backend runs the
same passes a CUDA capture runs, so what B and W compute is checked here on
the CPU; test_stages_cuda.py replays the real graphs."""

from __future__ import annotations

import copy
import gc
import sys
import weakref

import pytest
import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode
from torchvision.models.resnet import Bottleneck

from mpstream.runtime.graphed import Emulated
from mpstream.runtime.graphed import call as call_module
from mpstream.runtime.graphed.backend import Backend
from mpstream.runtime.graphed.call import GraphedCall
from mpstream.runtime.graphed.grads import GradStore
from mpstream.runtime.replay_autograd import replay
from tests.helpers import assert_same_grads, mlp
from tests.runtime.test_split_backward import Hooked


def graphed(
    stage: nn.Module, x: Tensor, split: bool = True, backend: Backend | None = None
) -> GraphedCall:
    """``stage`` called on ``x`` (which needs a gradient unless it is a
    leaf that does not), captured, its gradients going to ``stage``'s ``.grad``."""
    store = GradStore([p for p in stage.parameters() if p.requires_grad])
    need = [x.requires_grad or x.grad_fn is not None]
    return GraphedCall(
        stage, (x,), stage, x.device, True, backend or Emulated(), store, split=split, needs=need
    )


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
    plain backward's, replay after replay, adding into ``.grad`` (as
    ``train_step`` drives a split call; test_stages_cuda.py runs it on CUDA
    graphs)."""
    reference = copy.deepcopy(stage)
    call = graphed(stage, x.clone().requires_grad_(), backend=backend)
    assert call.passes == ("forward", "backward", "weight")
    for step in range(steps):  # later passes replay into the same buffers, adding
        (out,) = call.forward([x])
        grad = torch.randn_like(out)
        (got,) = call.backward([grad], token=step, weight=False)
        expected = plain(reference, x, grad)
        torch.testing.assert_close(got, expected)
        matrices = [n for n, p in stage.named_parameters() if p.dim() > 1]
        before = {n: p.grad.clone() for n, p in stage.named_parameters() if n in matrices}  # type: ignore[union-attr]
        call.weight()
        after = dict(stage.named_parameters())
        assert all(not torch.equal(before[n], after[n].grad) for n in matrices)  # type: ignore[arg-type]
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
    x = torch.randn(16, 64, requires_grad=True)

    def count(split: bool) -> tuple[int, int]:
        call = graphed(stage, x, split)
        (out,) = call.forward([x])
        with FlopCounterMode(display=False) as first:
            call.backward([torch.ones_like(out)], token=split, weight=False)
        with FlopCounterMode(display=False) as second:
            call.weight()
        return first.get_total_flops(), second.get_total_flops()

    whole, nothing = count(split=False)
    b, w = count(split=True)
    assert nothing == 0 and b > 0 and w > 0
    assert b + w == whole


def test_a_backward_through_autograd_runs_both_passes_of_a_split_call() -> None:
    stage = mlp([5, 8, 3])
    reference = copy.deepcopy(stage)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    call = graphed(stage, x)
    (out,) = replay(call, [x])
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
    (out,) = call.forward([x])
    grad = torch.randn_like(out)
    assert call.backward([grad], token=0, weight=False) == []
    assert all(p.grad is None or not p.grad.any() for p in stage.parameters())
    call.weight()
    plain(reference, x, grad)
    assert_same_grads(stage, reference)


def test_a_forward_replayed_between_b_and_w_is_refused_by_the_emulation() -> None:
    # On a GPU the schedule's slots rule this out; the emulation shows it.
    stage = mlp([5, 8, 3])
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    call = graphed(stage, x)
    (out,) = call.forward([x])
    call.backward([torch.ones_like(out)], token=0, weight=False)
    call.forward([x])  # overwrites the slot W still reads
    with pytest.raises(RuntimeError, match="weight pass replayed without its input-gradient"):
        call.weight()


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
    store = GradStore(list(stage.parameters()))
    call = GraphedCall(
        stage, (x, unused.requires_grad_()), stage, x.device, True, Emulated(), store, split=True
    )
    assert call.passes == ("forward", "weight")
    (out,) = replay(call, [x, unused])
    grad = torch.randn_like(out)
    out.backward(grad)
    assert unused.grad is None
    reference(x, unused).backward(grad)
    assert_same_grads(stage, reference)


def test_the_graphs_add_into_grad_and_one_zeroing_reattaches_it() -> None:
    stage = mlp([5, 8, 3])
    reference = copy.deepcopy(stage)
    x = torch.randn(4, 5, dtype=torch.float64)
    call = graphed(stage, x, split=False)
    for step in range(3):
        if step == 2:  # zero_grad(): None, then the views again, zeroed
            stage.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
        (out,) = call.forward([x])
        grad = torch.randn_like(out)
        call.backward([grad], token=step)
        plain(reference, x, grad)
        assert_same_grads(stage, reference)
        assert all(p.grad is v for p, v in zip(stage.parameters(), call.store.views))  # type: ignore[union-attr]


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

    store = GradStore(list(stage.parameters()))
    call = GraphedCall(fn, (x, 2.0), stage, x.device, True, Emulated(), store)
    example = weakref.ref(x)
    del x
    gc.collect()
    assert example() is None and captured and all(r() is None for r in captured)
    y = torch.randn(4, 5, dtype=torch.float64)
    out, label = call.rebuild(call.forward([y]))
    torch.testing.assert_close(out, stage(y) * 2.0)
    assert label == "label"


class Idle(Emulated):
    """Replays that do nothing (or raise): what is left is the call's own work."""

    fail = False

    def replay(self, call: GraphedCall, name: str) -> None:
        if self.fail:
            raise RuntimeError("replay failed")


def test_a_replay_inside_autograd_leaves_grad_mode_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # Grad mode is off inside autograd (the user's loop): turning it off
    # and on again around each replay cost a few microseconds per task.
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    backend = Idle()
    call = graphed(mlp([5, 8, 3]), x, split=False, backend=backend)
    replays = {GraphedCall.forward.__code__, GraphedCall.backward.__code__}
    sets: list[bool] = []
    real = call_module._set_grad

    def spy(on: bool) -> None:
        # One frame up: the replay itself, which switches grad mode inline.
        if sys._getframe(1).f_code in replays:
            sets.append(on)
        real(on)

    monkeypatch.setattr(call_module, "_set_grad", spy)
    (out,) = replay(call, [x])  # forward and backward replayed inside autograd
    out.backward(torch.ones_like(out))
    assert sets == []
    call.forward([x])  # outside autograd: off for the replay, then on again
    assert sets == [False, True] and torch.is_grad_enabled()
    backend.fail = True
    with pytest.raises(RuntimeError, match="replay failed"):
        call.forward([x])
    assert torch.is_grad_enabled()


def test_a_replay_outside_autograd_makes_no_grad_mode_object(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A training step's tasks replay with grad mode on: torch's own switch
    # turns it off and on, not torch.set_grad_enabled, a class whose
    # instance each switch would make (a Python call each, per task).
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    call = graphed(mlp([5, 8, 3]), x, split=False, backend=Idle())
    made: list[bool] = []
    real = torch.set_grad_enabled.__init__

    def counted(self: torch.set_grad_enabled, mode: bool) -> None:
        made.append(mode)
        real(self, mode)

    token, grad = object(), torch.ones(4, 3, dtype=torch.float64)
    call.forward([x])
    call.backward([grad], token)  # the pass's first: attaches .grad, under no_grad()
    monkeypatch.setattr(torch.set_grad_enabled, "__init__", counted)
    call.forward([x])
    call.backward([grad], token)
    assert made == [] and torch.is_grad_enabled()


class Wrapped(nn.Module):
    """Takes a one-tensor ``kind`` (tuple or list) whole, the batch itself
    if ``first``, and returns one."""

    def __init__(self, kind: type, first: bool = False) -> None:
        super().__init__()
        self.kind, self.first = kind, first
        self.layer = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, xs: Tensor | tuple[Tensor] | list[Tensor]) -> tuple[Tensor] | list[Tensor]:
        if self.first:
            x = xs
        else:
            assert type(xs) is self.kind, type(xs)  # not the tensor it holds
            (x,) = xs
        return self.kind([torch.tanh(self.layer(x))])


@pytest.mark.parametrize("kind", [tuple, list])
@pytest.mark.parametrize("run", ["loop", "step"])
def test_a_one_tensor_tuple_or_list_output_stays_one_when_replayed(kind: type, run: str) -> None:
    from mpstream import Pipe

    model = nn.Sequential(Wrapped(kind, first=True), Wrapped(kind), Wrapped(kind))
    pipe = Pipe(
        copy.deepcopy(model), chunks=2, balance=[1, 2], devices=["cpu"] * 2, graphs=Emulated()
    )
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)

    def loss(out: tuple[Tensor] | list[Tensor], target: Tensor) -> Tensor:
        assert type(out) is kind and len(out) == 1  # not the tensor it holds
        return nn.functional.mse_loss(out[0], target)

    for _ in range(3):  # the second call on replays
        for m in (model, pipe):
            m.zero_grad()
        if run == "loop":
            got = loss(pipe(x), y)
            got.backward()
        else:
            got = pipe.train_step(x, y, loss)
        want = loss(model(x), y)
        want.backward()
        torch.testing.assert_close(got, want)
        assert_same_grads(pipe, model)
    assert all(s.graphed for s in pipe.graph_report().stages)

"""Hooks in a split backward: a tensor hook where W starts (a junction's
output) runs once per micro-batch, in B, as in a plain backward, under
every zero-bubble schedule, with the plain model's gradients (input,
parameter, retained ``.grad``) and seeing what it would see there, however
and wherever it was registered; a module's full backward hooks and
pre-hooks too. W mutes a junction's hooks with
``mpstream._C.MutedHooks`` (see ``mpstream/runtime/split_hooks.py``),
tested here on plain autograd graphs too."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from mpstream import Pipe
from mpstream.runtime.boundary import GradSink, cut
from mpstream.runtime.split_backward import backward_inputs
from mpstream.runtime.split_hooks import mute, pinned
from tests.helpers import assert_same_grads

Hook = Callable[[Tensor], Tensor | None]


def _double_in_place(g: Tensor) -> None:
    g.mul_(2)


def _floor_in_place(g: Tensor) -> None:
    g.masked_fill_(g.abs() < 1e-3, 1e-3)


HOOKS: dict[str, Hook | None] = {
    "clamp_in_place": lambda g: g.clamp_(-0.01, 0.01),
    "mul_in_place_returning_none": _double_in_place,
    "floor_in_place": _floor_in_place,
    "plus_one": lambda g: g + 1,
    "retain_only": None,
}
REGISTER = Tensor.register_hook  # torch's, as code imported before may hold it
# The zero-bubble schedules (a W task per split backward), and their virtual stages.
ZERO_BUBBLE = {"zb_h1": None, "interleaved_zb": 2, "zbv": 2, "dualpipev": 2}


class Hooked(nn.Module):
    """A linear layer whose output keeps its gradient and carries a hook;
    the hook's calls record the gradient they were given, by forward call
    (a micro-batch)."""

    def __init__(self, hook: Hook | None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.hook = hook
        self.kept: list[Tensor] = []
        self.seen: list[tuple[int, Tensor]] = []

    def forward(self, x: Tensor) -> Tensor:
        h: Tensor = self.lin(x)
        h.retain_grad()
        hook, index = self.hook, len(self.kept)
        if hook is not None:

            def call(g: Tensor) -> Tensor | None:
                self.seen.append((index, g.detach().clone()))
                return hook(g)

            h.register_hook(call)
        self.kept.append(h)
        return h


def model(hook: Hook | None) -> nn.Sequential:
    """Four hooked layers, one per stage of ``balance=[2, 2, 2, 2]``: those
    of the stages after the first are junctions (their input path leads
    to a cut input)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [Hooked(hook), nn.Tanh()]
    layers[-1] = nn.Linear(4, 3)
    return nn.Sequential(*layers).double()


def pipe_of(ref: nn.Module, split_size: int, schedule: str) -> Pipe:
    return Pipe(copy.deepcopy(ref), split_size=split_size, balance=[2, 2, 2, 2],
                devices=["cpu"] * 4, schedule=schedule,
                virtual_stages=ZERO_BUBBLE.get(schedule))  # fmt: skip


def hooked(m: nn.Module) -> list[Hooked]:
    return [layer for layer in m.modules() if isinstance(layer, Hooked)]


def assert_same_retained(got: Hooked, expected: Hooked) -> None:
    """The micro-batches' retained gradients, stacked, are the whole batch's."""
    (whole,) = expected.kept
    assert whole.grad is not None and all(h.grad is not None for h in got.kept)
    torch.testing.assert_close(torch.cat([h.grad for h in got.kept]), whole.grad)  # type: ignore[misc]


def assert_hooked_once_per_micro_batch(got: Hooked, expected: Hooked, micros: int) -> None:
    """The hook ran once per micro-batch, and what its calls saw, stacked,
    is what the plain model's one call saw."""
    if expected.hook is None:
        return
    assert sorted(i for i, _ in got.seen) == list(range(micros)), "one call per micro-batch"
    seen = [g for _, g in sorted(got.seen, key=lambda s: s[0])]
    torch.testing.assert_close(torch.cat(seen), expected.seen[0][1])


def split_stage(stage: nn.Module, x: Tensor, grad: Tensor) -> GradSink:
    """B then W of ``stage`` on ``x`` (cut, as in a pipeline), outside any
    training step; returns the input gradient's sink."""
    sink = GradSink()
    out = stage(cut(sink, (x,))[0])
    backward_inputs([out], [grad]).run()
    return sink


@pytest.mark.parametrize("name", HOOKS)
def test_b_then_w_with_a_hook_at_a_junction(name: str) -> None:
    stage = nn.Sequential(Hooked(HOOKS[name]), nn.Tanh(), nn.Linear(4, 3)).double()
    twin = copy.deepcopy(stage)
    x = torch.randn(5, 4, dtype=torch.float64)
    torch.manual_seed(1)
    grad = torch.randn(5, 3, dtype=torch.float64)
    sink = GradSink()
    torch.autograd.backward([stage(cut(sink, (x,))[0])], [grad])
    split = split_stage(twin, x, grad)
    torch.testing.assert_close(split.grads, sink.grads)
    assert_same_grads(twin, stage)
    assert_same_retained(twin[0], stage[0])
    assert_hooked_once_per_micro_batch(twin[0], stage[0], 1)


def test_a_hook_registered_in_a_forward_run_by_hand_runs_once() -> None:
    """No training step around the forward: W mutes the hook all the same."""
    stage = nn.Sequential(Hooked(lambda g: None), nn.Tanh(), nn.Linear(4, 3)).double()
    x, grad = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    split_stage(stage, x, grad)
    ((_, real),) = stage[0].seen
    assert real.any()


class Twice(torch.autograd.Function):
    """A custom Function: its node is a THPFunction, not a C++ node."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return g * 2


@pytest.mark.parametrize("kind", ["operator", "custom_function"])
def test_mute_takes_a_nodes_tensor_hooks_off_until_restore(kind: str) -> None:
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    y = x * 2 if kind == "operator" else Twice.apply(x)
    calls: list[Tensor] = []
    y.register_hook(lambda g: calls.append(g))
    y.register_hook(lambda g: g + 1)  # into the same dict: one hook on the node
    y.retain_grad()
    assert y.grad_fn is not None
    muted = mute(y.grad_fn)
    assert len(muted) == 1
    ones = torch.ones(3, dtype=torch.float64)
    y.backward(ones, retain_graph=True)
    assert calls == []
    # retain_grad's hook stays, and the gradient goes on unchanged.
    torch.testing.assert_close(y.grad, ones)
    torch.testing.assert_close(x.grad, 2 * ones)
    muted.restore()
    muted.restore()  # once
    assert len(muted) == 0
    y.backward(ones)
    assert len(calls) == 1
    torch.testing.assert_close(y.grad, 2 * ones + 1)  # the second hook's g + 1
    torch.testing.assert_close(x.grad, 2 * ones + 2 * (ones + 1))


def test_mute_keeps_hooks_added_meanwhile_after_the_restored_ones() -> None:
    """Output 1's hook, registered while the node's hooks are off, stays,
    and runs after output 0's (registered before)."""
    w = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    first, second = (w * 2).unbind(0)
    calls: list[str] = []
    first.register_hook(lambda g: calls.append("first"))
    assert first.grad_fn is not None and first.grad_fn is second.grad_fn
    muted = mute(first.grad_fn)
    second.register_hook(lambda g: calls.append("second"))
    assert len(muted) == 1
    del muted  # restores, as restore() does
    torch.autograd.backward([first, second], [torch.ones(3, dtype=torch.float64)] * 2)
    assert calls == ["first", "second"]


def test_mute_refuses_what_is_not_an_autograd_node() -> None:
    with pytest.raises(TypeError, match="autograd node .*not Tensor"):
        mute(torch.ones(2))  # type: ignore[arg-type]


def test_w_mutes_the_hooks_at_every_output_of_a_node_and_gives_them_back() -> None:
    """W may start at output 1 of a node of several outputs: none of the
    node's tensor hooks runs, and after W, failed or not, they are back."""
    w = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    calls: list[Tensor] = []
    first, second = (w * 2).unbind(0)
    for t in (first, second):
        t.register_hook(lambda g: calls.append(g))
    second.retain_grad()
    second.register_hook(lambda g: g + 1)
    node = second.grad_fn
    assert node is not None and second.output_nr == 1
    kept = torch.full((3,), 0.5, dtype=torch.float64)
    second.grad = kept.clone()  # as B left it
    zeros = torch.zeros(3, dtype=torch.float64)

    def fail(g: Tensor) -> None:
        raise RuntimeError("failed W")

    # A hook on the parameter fails W once the node ran (before the
    # gradient accumulates); the graph is retained for the next call.
    handle = w.register_hook(fail)
    with pytest.raises(RuntimeError, match="failed W"), pinned({node: [None, kept]}):
        torch.autograd.backward([GradientEdge(node, 1)], [zeros], inputs=[w], retain_graph=True)  # type: ignore[arg-type]
    handle.remove()
    assert calls == [] and w.grad is None
    with pinned({node: [None, kept]}):
        torch.autograd.backward([GradientEdge(node, 1)], [zeros], inputs=[w])  # type: ignore[arg-type]
    assert calls == []
    torch.testing.assert_close(second.grad, kept)
    torch.testing.assert_close(w.grad, torch.stack([zeros, 2 * kept]))


def test_a_failed_w_gives_a_junctions_hooks_back() -> None:
    """W raises (a user's hook on a weight W computes, registered after
    B): the junction's hook did not run in W, and the next backward through
    the junction runs it once (then fails: W ran the junction, freeing
    what it saved)."""
    stage = nn.Sequential(Hooked(lambda g: None), nn.Tanh(), nn.Linear(4, 3)).double()
    x, grad = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    out = stage(cut(GradSink(), (x,))[0])
    weight = backward_inputs([out], [grad])
    (h,) = stage[0].kept
    assert h.grad_fn is not None and len(stage[0].seen) == 1

    def fail(g: Tensor) -> None:
        raise RuntimeError("failed W")

    handle = stage[0].lin.weight.register_hook(fail)
    with pytest.raises(RuntimeError, match="failed W"):
        weight.run()
    handle.remove()
    assert len(stage[0].seen) == 1, "the hook ran in W"
    again = torch.randn(5, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="second time"):
        h.backward(again)
    assert len(stage[0].seen) == 2
    torch.testing.assert_close(stage[0].seen[1][1], again)


@pytest.mark.parametrize("split_size", [2, 3], ids=["dividing", "not_dividing"])
@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
@pytest.mark.parametrize("name", HOOKS)
def test_train_step_with_hooks_equals_the_plain_model(
    name: str, schedule: str, split_size: int
) -> None:
    ref = model(HOOKS[name])
    pipe = pipe_of(ref, split_size, schedule)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    loss = pipe.train_step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)
    micros = -(-8 // split_size)
    for got, plain in zip(hooked(pipe), hooked(ref), strict=True):
        assert_same_retained(got, plain)
        assert_hooked_once_per_micro_batch(got, plain, micros)


@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
@pytest.mark.parametrize("register", ["method", "held"])
def test_a_hook_from_a_forward_hook_runs_once(register: str, schedule: str) -> None:
    """A forward hook installed on the model before the pipe is made
    registers a tensor hook on each linear layer's output (a junction in
    the stages after the first): with ``out.register_hook``, or with torch's
    ``register_hook`` held from before (as another library may)."""
    seen: dict[int, list[Tensor]] = {}

    def forward_hook(m: nn.Module, inputs: Any, out: Tensor) -> None:
        def call(g: Tensor) -> None:
            seen.setdefault(id(m), []).append(g.detach().clone())

        if register == "method":
            out.register_hook(call)
        else:
            REGISTER(out, call)

    ref = model(None)
    for layer in hooked(ref):
        layer.lin.register_forward_hook(forward_hook)
    pipe = pipe_of(ref, 2, schedule)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    pipe.train_step(x, y, nn.MSELoss())
    nn.MSELoss()(ref(x), y).backward()
    assert_same_grads(pipe, ref)
    for got, plain in zip(hooked(pipe), hooked(ref), strict=True):
        calls, (whole,) = seen[id(got.lin)], seen[id(plain.lin)]
        assert len(calls) == 4, "one call per micro-batch"
        torch.testing.assert_close(torch.cat(calls), whole)


class Full(nn.Module):
    """Records its module's full backward hook and pre-hook calls: what
    each saw (the gradients of its input and output)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre: list[Tensor] = []
        self.full: list[tuple[Tensor | None, Tensor]] = []

    def attach(self, m: nn.Module) -> None:
        m.register_full_backward_pre_hook(lambda _, go: self.pre.append(go[0].clone()))
        m.register_full_backward_hook(lambda _, gi, go: self.full.append((gi[0], go[0].clone())))


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("split_size", [2, 3], ids=["dividing", "not_dividing"])
@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
def test_module_backward_hooks_run_as_in_the_plain_model(schedule: str, split_size: int) -> None:
    """A module's full backward hook and pre-hook (on the junction's layer)
    run once per micro-batch, seeing the plain model's gradients: B runs
    them, W starts below them."""
    ref = model(None)
    pipe = pipe_of(ref, split_size, schedule)
    records = []
    for m in (ref, pipe):
        layers = [layer.lin for layer in hooked(m)] + [list(m.modules())[-1]]
        records.append([Full() for _ in layers])
        for record, layer in zip(records[-1], layers):
            record.attach(layer)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    pipe.train_step(x, y, nn.MSELoss())
    nn.MSELoss()(ref(x), y).backward()
    assert_same_grads(pipe, ref)
    micros = -(-8 // split_size)
    for got, plain in zip(records[1], records[0], strict=True):
        assert len(got.pre) == len(got.full) == micros
        # Each stage's backwards run in micro-batch order.
        torch.testing.assert_close(torch.cat(got.pre), plain.pre[0])
        torch.testing.assert_close(torch.cat([go for _, go in got.full]), plain.full[0][1])
        if plain.full[0][0] is None:  # the first layer: its input needs no gradient
            assert all(gi is None for gi, _ in got.full)
        else:
            torch.testing.assert_close(torch.cat([gi for gi, _ in got.full]), plain.full[0][0])  # type: ignore[misc]


@pytest.mark.parametrize("split_size", [2, 3], ids=["dividing", "not_dividing"])
@pytest.mark.parametrize("name", HOOKS)
def test_the_users_loop_with_hooks_equals_the_plain_model(name: str, split_size: int) -> None:
    """``pipe(x)`` then ``loss.backward()`` is not split, under a zero-bubble
    schedule too: each hook runs once per micro-batch."""
    ref = model(HOOKS[name])
    pipe = pipe_of(ref, split_size, "zb_h1")
    x = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, expected = pipe(x), ref(x_ref)
    torch.testing.assert_close(out, expected)
    out.pow(2).mean().backward()
    expected.pow(2).mean().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert_same_grads(pipe, ref)
    micros = -(-8 // split_size)
    for got, plain in zip(hooked(pipe), hooked(ref), strict=True):
        assert_same_retained(got, plain)
        assert_hooked_once_per_micro_batch(got, plain, micros)

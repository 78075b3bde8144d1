"""Tensor hooks where a split backward's W starts (a junction's output):
input and parameter gradients and a retained ``.grad`` are the plain
model's for a hook returning its result, zero-preserving or not, or
writing in place where torch writes into W's one-element zeros
(``masked_fill_``); one whose write torch refuses there (``clamp_``) fails
in W with a note saying what to do.

A hook there runs in B on the real gradient, and again in W on zeros whose
result W drops (see ``mpstream/runtime/split_backward.py``); elsewhere it
runs once per micro-batch."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from mpstream import Pipe
from mpstream.runtime.boundary import GradSink, cut
from mpstream.runtime.split_backward import backward_inputs
from mpstream.runtime.split_hooks import pinned
from tests.helpers import assert_same_grads

Hook = Callable[[Tensor], Tensor | None]


def _double_in_place(g: Tensor) -> None:
    g.mul_(2)


def _floor_in_place(g: Tensor) -> None:
    # Torch writes this into W's one-element zeros (clamp_ it refuses),
    # warning that it will not in a later version.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        g.masked_fill_(g.abs() < 1e-3, 1e-3)


IN_PLACE = {"clamp_in_place", "mul_in_place_returning_none"}
HOOKS: dict[str, Hook | None] = {
    "clamp_in_place": lambda g: g.clamp_(-0.01, 0.01),
    "mul_in_place_returning_none": _double_in_place,
    "floor_in_place": _floor_in_place,
    "plus_one": lambda g: g + 1,
    "retain_only": None,
}


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
    """Two hooked layers, one per stage of ``balance=[2, 3]``: the second
    stage's is a junction (its input path leads to a cut input)."""
    torch.manual_seed(0)
    layers = [Hooked(hook), nn.Tanh(), Hooked(hook), nn.Tanh(), nn.Linear(4, 3)]
    return nn.Sequential(*layers).double()


def hooked(m: nn.Module) -> list[Hooked]:
    return [layer for layer in m.modules() if isinstance(layer, Hooked)]


def assert_same_retained(got: Hooked, expected: Hooked) -> None:
    """The micro-batches' retained gradients, stacked, are the whole batch's."""
    (whole,) = expected.kept
    assert whole.grad is not None and all(h.grad is not None for h in got.kept)
    torch.testing.assert_close(torch.cat([h.grad for h in got.kept]), whole.grad)  # type: ignore[misc]


def assert_hooked_once_per_micro_batch(got: Hooked, expected: Hooked, micros: int) -> int:
    """Each micro-batch's real gradient reached the hook once, and together
    they are the whole batch's; returns the calls given zeros (W's)."""
    if expected.hook is None:
        return 0
    real = sorted(((i, g) for i, g in got.seen if g.any()), key=lambda seen: seen[0])
    assert [i for i, _ in real] == list(range(micros))
    torch.testing.assert_close(torch.cat([g for _, g in real]), expected.seen[0][1])
    return len(got.seen) - len(real)


def assert_says_what_to_do(exc: BaseException) -> None:
    notes = "\n".join(getattr(exc, "__notes__", []))
    assert "hook that changes its gradient in place" in notes, notes
    assert "return g.clamp(...)" in notes and "gpipe, 1f1b" in notes


@pytest.mark.parametrize("name", HOOKS)
def test_b_then_w_with_a_hook_at_a_junction(name: str) -> None:
    hook = HOOKS[name]
    stage = nn.Sequential(Hooked(hook), nn.Tanh(), nn.Linear(4, 3)).double()
    twin = copy.deepcopy(stage)
    plain, split = stage[0], twin[0]
    x = torch.randn(5, 4, dtype=torch.float64)
    torch.manual_seed(1)
    grad = torch.randn(5, 3, dtype=torch.float64)
    sinks = []
    for s, is_split in ((stage, False), (twin, True)):
        sink = GradSink()
        out = s(cut(sink, (x,))[0])
        if is_split:
            weight = backward_inputs([out], [grad])
            if name in IN_PLACE:
                with pytest.raises(RuntimeError) as failed:
                    weight.run()
                assert_says_what_to_do(failed.value)
                return
            weight.run()
        else:
            torch.autograd.backward([out], [grad])
        sinks.append(sink.grads)
    torch.testing.assert_close(sinks[1], sinks[0])
    assert_same_grads(twin, stage)
    assert_same_retained(split, plain)
    if hook is not None:
        assert len(split.seen) == 2 and not split.seen[1][1].any(), "W's call gets zeros"
    assert_hooked_once_per_micro_batch(split, plain, 1)


def test_w_drops_what_hooks_return_at_any_output_of_a_node() -> None:
    """W may start at output 1 of a node of several outputs: the hook
    there changes neither the retained ``.grad`` nor what the node gets."""
    w = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    _, second = (w * 2).unbind(0)
    second.retain_grad()
    second.register_hook(lambda g: g + 1)
    node = second.grad_fn
    assert node is not None and second.output_nr == 1
    kept = torch.full((3,), 0.5, dtype=torch.float64)
    second.grad = kept.clone()  # as B left it
    zeros = torch.zeros(3, dtype=torch.float64)
    group = ([GradientEdge(node, 1)], [zeros], [w])
    with pinned({node: [None, kept]}, [group]):
        torch.autograd.backward([GradientEdge(node, 1)], [zeros], inputs=[w])  # type: ignore[arg-type]
    torch.testing.assert_close(second.grad, kept)
    expected = torch.stack([torch.zeros(3, dtype=torch.float64), 2 * kept])
    torch.testing.assert_close(w.grad, expected)


@pytest.mark.parametrize("split_size", [2, 3], ids=["dividing", "not_dividing"])
@pytest.mark.parametrize("name", HOOKS)
def test_train_step_with_hooks_equals_the_plain_model(name: str, split_size: int) -> None:
    ref = model(HOOKS[name])
    pipe = Pipe(copy.deepcopy(ref), split_size=split_size, balance=[2, 3],
                devices=["cpu", "cpu"], schedule="zb_h1")  # fmt: skip
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    if name in IN_PLACE:
        with pytest.raises(RuntimeError) as failed:
            pipe.train_step(x, y, nn.MSELoss())
        assert_says_what_to_do(failed.value)
        assert all(p.grad is None for p in pipe.parameters()), "the failed step left nothing"
        return
    loss = pipe.train_step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)
    micros = -(-8 // split_size)
    first, second = hooked(pipe)
    for got, plain in zip((first, second), hooked(ref)):
        assert_same_retained(got, plain)
    # The first stage has no cut input: its W does the whole backward, once.
    assert assert_hooked_once_per_micro_batch(first, hooked(ref)[0], micros) == 0
    # The second's junction: each W calls the hook again, on zeros.
    again = assert_hooked_once_per_micro_batch(second, hooked(ref)[1], micros)
    assert again == (micros if HOOKS[name] is not None else 0)


@pytest.mark.parametrize("split_size", [2, 3], ids=["dividing", "not_dividing"])
@pytest.mark.parametrize("name", HOOKS)
def test_the_users_loop_with_hooks_equals_the_plain_model(name: str, split_size: int) -> None:
    """``pipe(x)`` then ``loss.backward()`` is not split, under a zero-bubble
    schedule too: each hook runs once per micro-batch."""
    ref = model(HOOKS[name])
    pipe = Pipe(copy.deepcopy(ref), split_size=split_size, balance=[2, 3],
                devices=["cpu", "cpu"], schedule="zb_h1")  # fmt: skip
    x = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, expected = pipe(x), ref(x_ref)
    torch.testing.assert_close(out, expected)
    out.pow(2).mean().backward()
    expected.pow(2).mean().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert_same_grads(pipe, ref)
    micros = -(-8 // split_size)
    for got, plain in zip(hooked(pipe), hooked(ref)):
        assert_same_retained(got, plain)
        assert assert_hooked_once_per_micro_batch(got, plain, micros) == 0

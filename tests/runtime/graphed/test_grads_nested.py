"""Backward passes through graphed stages run from inside another (a custom
Function's backward), and ``torch.autograd.grad`` through them. A backward
that leaves ``.grad`` alone keeps what the outer pass's replays reached
before it, its hooks, its tied weights' sums and the streams its final
flush orders the caller's after; its own caller's streams wait for the
gradients put back. A plain ``backward()`` inside a pass gets hooks and
gradients as eager autograd's (on fake streams, and on a GPU); a
``train_step`` inside one leaves the outer pass's gradients whole."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime import replay_autograd as replay
from mpstream.runtime.graphed import Emulated, attaching, grads, passes
from mpstream.runtime.graphed.call import GraphedCall
from mpstream.runtime.graphed.grads import GradStore
from tests.cuda.helpers import two_gpus
from tests.helpers import assert_same_grads, mlp
from tests.runtime.graphed.test_grads import tied_model
from tests.runtime.graphed.test_grads_shared import Delayed, FakeStream, unordered_reads


class Nested(torch.autograd.Function):
    """Calls ``run`` from its backward (the identity's)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, run: Callable[[], None]) -> Tensor:  # type: ignore[override]
        ctx.run = run
        return t.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        ctx.run()
        return g, None


def nested_pass(m: nn.Module, x: Tensor, x2: Tensor) -> Tensor:
    """A backward of ``m(x)`` whose replays run first, then, inside the same
    pass, ``torch.autograd.grad`` through ``m(x2)`` (other shapes: other
    graphs of the same stages); returns the gradient of ``x2``."""
    inp = x2.clone().requires_grad_()
    other = m(inp).square().sum()
    got: list[Tensor] = []
    t = Nested.apply(torch.zeros(1, dtype=x.dtype, requires_grad=True), lambda: got.extend(
        torch.autograd.grad(other, [inp])
    ))  # fmt: skip
    out = m(x)  # made after t: autograd runs its backward first
    (t.sum() + out.square().sum()).backward()
    return got[0]


def test_autograd_grad_inside_a_pass_keeps_its_hooks_and_tied_sums() -> None:
    model = tied_model()
    eager, graphed = (
        Pipe(copy.deepcopy(model), chunks=2, balance=[2, 2, 2], devices=["cpu"] * 3, graphs=g)
        for g in (False, Emulated())
    )  # fmt: skip
    x, x2 = torch.randn(6, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    ran = {"eager": Counter[str](), "graphed": Counter[str]()}
    for tag, pipe in (("eager", eager), ("graphed", graphed)):
        for name, p in pipe.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, n=name, c=ran[tag]: c.update([n]))
    for _ in range(3):  # captures, then replays
        for c in ran.values():
            c.clear()
        gots = [nested_pass(pipe, x, x2) for pipe in (eager, graphed)]
        torch.testing.assert_close(gots[1], gots[0])
        assert_same_grads(graphed, eager)
        assert ran["graphed"] == ran["eager"]  # once per parameter: one accumulation


def on_fake_streams(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, Any]]:
    """Each stage's graphs add (and a Replay's backward runs) on a fake
    stream of the stage's own, the rest on the caller's; returns the log of
    their waits, the gradient adds and the buffers a store puts back (see
    ``unordered_reads``)."""
    log: list[tuple[str, str, Any]] = []
    streams: dict[str, FakeStream] = {}
    current = [FakeStream("caller", log)]

    def on_stage_stream(method: Any, label: Callable[..., str]) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            before = current[0]
            name = label(*args)
            current[0] = streams.setdefault(name, FakeStream(name, log))
            try:
                return method(*args, **kwargs)
            finally:
                current[0] = before

        return run

    def added(dst: list[Tensor], src: list[Tensor]) -> None:
        log.append(("add", current[0].name, ([id(t) for t in src + dst], [id(t) for t in dst])))
        plain(dst, src)

    def restored(store: GradStore) -> None:
        restore(store)
        log.append(("copy", current[0].name, ([], [id(v) for v in store.views])))

    plain, restore = torch._foreach_add_, GradStore.restore
    for module in (grads, passes):
        monkeypatch.setattr(module, "current_stream", lambda device: current[0])
    monkeypatch.setattr(attaching, "record_stream", lambda t, s: None)
    for name in ("backward", "weight"):
        method = on_stage_stream(getattr(GraphedCall, name), lambda call, *_: call.label)
        monkeypatch.setattr(GraphedCall, name, method)
    backward = on_stage_stream(replay.Replay.backward, lambda ctx, *_: ctx.call.label)
    monkeypatch.setattr(replay.Replay, "backward", staticmethod(backward))
    monkeypatch.setattr(torch, "_foreach_add_", added)
    monkeypatch.setattr(GradStore, "restore", restored)
    return log


def three_stages(model: nn.Module | None = None) -> Pipe:
    """A pipe of ``model`` (``mlp([5, 5, 5, 5])``) in three CPU stages, emulated."""
    model = model or mlp([5, 5, 5, 5])
    return Pipe(model, chunks=2, balance=[2, 2, 2], devices=["cpu"] * 3, graphs=Emulated())


def assert_caller_reads_in_order(log: list[tuple[str, str, Any]], pipe: Pipe) -> None:
    """The caller reading every ``.grad`` now reads each after its last write."""
    log.append(("add", "caller", ([id(p.grad) for p in pipe.parameters()], [])))
    bad, crossed = unordered_reads(log)
    assert not bad, bad
    assert crossed, "no stage stream wrote a .grad"


def test_autograd_grad_inside_a_pass_keeps_the_streams_its_flush_orders(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each stage's graphs add (and a Replay's backward runs) on the stage's
    # own stream; the caller reads .grad after the pass on its own. The
    # pass's flush must order it after every stage stream that added.
    log = on_fake_streams(monkeypatch)
    pipe = three_stages()
    x, x2 = torch.randn(6, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    for _ in range(2):  # captures, then replays
        log.clear()
        nested_pass(pipe, x, x2)
        assert_caller_reads_in_order(log, pipe)


def test_autograd_grad_orders_the_caller_after_the_gradients_put_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No pass open: each stage puts its buffers (.grad) back on its own
    # stream at the end of its replayed backward; the caller reads or zeroes
    # .grad on its own right after torch.autograd.grad returns.
    log = on_fake_streams(monkeypatch)
    pipe = three_stages()
    x = torch.randn(6, 5, dtype=torch.float64)
    for _ in range(2):  # captures, then replays: .grad is the buffers
        pipe(x).square().sum().backward()
    for _ in range(2):
        log.clear()
        inp = x.clone().requires_grad_()
        torch.autograd.grad(pipe(inp).square().sum(), [inp])
        assert_caller_reads_in_order(log, pipe)


def backward_inside_a_pass(m: nn.Module, x: Tensor, x2: Tensor) -> None:
    """A backward of ``m(x)`` whose replays run first, then, inside the same
    pass, a plain backward through ``m(x2)``."""

    def inner() -> None:
        with torch.enable_grad():
            m(x2).square().sum().backward()

    t = Nested.apply(torch.zeros(1, dtype=x.dtype, requires_grad=True), inner)
    (t.sum() + m(x).square().sum()).backward()  # m(x) made after t: its backward first


def seen_by_hooks(m: nn.Module, take: bool = False) -> dict[str, list[Tensor]]:
    """Per parameter, each ``.grad`` its post-accumulate hooks were given;
    with ``take``, the hook then sets it to None (an optimizer in backward)."""
    seen: dict[str, list[Tensor]] = {}

    def hook(p: Tensor, name: str) -> None:
        seen.setdefault(name, []).append(p.grad.clone())  # type: ignore[union-attr]
        if take:
            p.grad = None

    for name, p in m.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: hook(p, name))
    return seen


@pytest.mark.parametrize("take", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_a_backward_inside_a_pass_runs_each_pass_s_hooks_as_eager_autograd(
    tied: bool, take: bool
) -> None:
    # Eager autograd accumulates the outer pass's gradients (and runs their
    # hooks) before the inner pass starts, then the inner's: two hooks per
    # parameter, the first with the outer gradient alone (the second with
    # the inner's alone where the first took .grad away).
    model = tied_model() if tied else mlp([5, 5, 5, 5])
    pipe = three_stages(copy.deepcopy(model))
    x, x2 = torch.randn(6, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    seen = [seen_by_hooks(m, take) for m in (model, pipe)]
    for _ in range(3):  # captures, then replays
        for m, got in zip((model, pipe), seen):
            got.clear()
            m.zero_grad()
            backward_inside_a_pass(m, x, x2)
        assert seen[1].keys() == seen[0].keys()
        for name, grads_seen in seen[0].items():
            assert len(grads_seen) == 2, name
            torch.testing.assert_close(seen[1][name], grads_seen, msg=name)
        if take:
            assert all(p.grad is None for m in (model, pipe) for p in m.parameters())
        else:
            assert_same_grads(pipe, model)


def step_inside_a_pass(m: nn.Module, x: Tensor, x2: Tensor, y: Tensor, how: str) -> None:
    """A backward through ``m(x)`` and ``m(x2)`` that, once ``m(x2)``'s
    replays ran and before ``m(x)``'s, runs a training step of ``m`` on
    ``x`` (the plain model: a backward of the same loss), from a hook on
    ``x2``'s gradient or from a custom Function's backward (``how``)."""

    def inner() -> None:
        with torch.enable_grad():
            if isinstance(m, Pipe):
                m.train_step(x, y, nn.MSELoss())
            else:
                nn.functional.mse_loss(m(x), y).backward()

    first = m(x)
    inp = x2.clone().requires_grad_()
    if how == "tensor_hook":
        inp.register_hook(lambda g: inner())
        second = m(inp)
    else:
        second = m(Nested.apply(inp, inner))
    (nn.functional.mse_loss(first, y) + nn.functional.mse_loss(second, y)).backward()


@pytest.mark.parametrize("how", ["tensor_hook", "function"])
def test_a_training_step_inside_a_pass_keeps_the_outer_pass_s_gradients(how: str) -> None:
    # The step saves the gradient buffers (to undo a failed step): the
    # outer pass's part so far, hooks and tied side sums, must end first,
    # not be forgotten as a failed pass's.
    model = tied_model()
    pipe = three_stages(copy.deepcopy(model))
    x, x2, y = (torch.randn(6, 5, dtype=torch.float64) for _ in range(3))
    hooked = [Counter[str]() for _ in range(2)]
    for m, ran in zip((model, pipe), hooked):
        for name, p in m.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, n=name, ran=ran: ran.update([n]))
    for _ in range(3):  # captures, then replays
        for m in (model, pipe):
            m.zero_grad()
            step_inside_a_pass(m, x, x2, y, how)
        assert_same_grads(pipe, model)
    # Per round: the step's hooks once per micro-batch (a tied weight's once
    # per step), the outer pass's once per part (before the step, after it).
    assert hooked[0] == Counter({n: 3 * 2 for n in hooked[0]})
    assert hooked[1] == Counter({n: 3 * ((1 if n == "0.weight" else 2) + 2) for n in hooked[0]})


@pytest.mark.cuda
def test_cuda_autograd_grad_inside_a_pass_leaves_its_gradients_whole() -> None:
    torch.manual_seed(0)
    model = tied_model().cuda()
    eager, graphed = (
        Pipe(copy.deepcopy(model), chunks=2, balance=[2, 2, 2], devices=["cuda:0"] * 3, graphs=g)
        for g in (False, True)
    )  # fmt: skip
    x, x2 = (torch.randn(n, 5, dtype=torch.float64, device="cuda") for n in (6, 4))
    for _ in range(3):  # captures, then replays
        for pipe in (eager, graphed):
            pipe.zero_grad()
        gots = [nested_pass(pipe, x, x2) for pipe in (eager, graphed)]
        torch.testing.assert_close(gots[1], gots[0])
        assert_same_grads(graphed, eager)
    assert all(s.graphed for s in graphed.graph_report().stages), graphed.graph_report()


@pytest.mark.cuda
@pytest.mark.parametrize(
    "devices", [["cuda:0"] * 2, pytest.param(["cuda:0", "cuda:1"], marks=two_gpus)]
)
def test_cuda_grad_zeroed_right_after_autograd_grad_stays_zero(devices: list[str]) -> None:
    # The last stage's backward sleeps before its gradient adds, which its
    # put-back follows on its stream; the caller zeroes .grad at once on its
    # own (on the second device, no gradient autograd hands on orders it).
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), Delayed(), nn.Linear(64, 64)).double()
    pipe = Pipe(model, balance=[2, 2], devices=devices, chunks=2, graphs=True)
    x = torch.randn(8, 64, dtype=torch.float64, device=devices[0])
    for _ in range(3):  # captures, then replays: .grad is the buffers
        pipe(x).square().sum().backward()
    inp = x.clone().requires_grad_()
    torch.autograd.grad(pipe(inp).square().sum(), [inp])
    for p in pipe.parameters():
        p.grad.zero_()  # type: ignore[union-attr]
    torch.cuda.synchronize()
    assert not any(p.grad.any() for p in pipe.parameters())  # type: ignore[union-attr]
    assert all(s.graphed for s in pipe.graph_report().stages), pipe.graph_report()


@pytest.mark.cuda
def test_cuda_a_backward_inside_a_pass_runs_each_pass_s_hooks_as_eager_autograd() -> None:
    # Stage 0's graphs add late (a sleep): the outer pass's hooks, run
    # where the inner pass first replays (the last stage's stream), must
    # wait for them, and the inner's adds for those hooks.
    torch.manual_seed(0)
    layers = [nn.Linear(32, 32), Delayed(), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 32)]
    model = nn.Sequential(*layers).double().cuda()
    pipe = Pipe(copy.deepcopy(model), chunks=2, balance=[3, 1, 1], devices=["cuda:0"] * 3,
                graphs=True)  # fmt: skip
    x, x2 = (torch.randn(n, 32, dtype=torch.float64, device="cuda") for n in (6, 4))
    seen = [seen_by_hooks(m) for m in (model, pipe)]
    for _ in range(3):  # captures, then replays
        for m, got in zip((model, pipe), seen):
            got.clear()
            m.zero_grad()
            backward_inside_a_pass(m, x, x2)
        torch.cuda.synchronize()
        for name, grads_seen in seen[0].items():
            torch.testing.assert_close(seen[1][name], grads_seen, msg=name)
        assert_same_grads(pipe, model)
    assert all(s.graphed for s in pipe.graph_report().stages), pipe.graph_report()

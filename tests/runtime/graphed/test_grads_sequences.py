"""Sequences of calls a training loop makes, on a graphed pipe (replays
emulated) against the plain model: several backward passes per step,
``torch.autograd.grad`` and ``backward(inputs=)`` between them, gradients
zeroed either way, blocks frozen and unfrozen, ``no_grad`` and eval calls,
a step that fails midway, batch sizes that re-key the calls, tied weights
and two pipes over one module, over every built-in schedule and
checkpoint mode. What a gradient store may keep of a pass (``GradStore.ready``)
must never outlive what it was true for."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated
from mpstream.schedules import SCHEDULES
from tests.helpers import mlp, virtual_for
from tests.models import FailOnce

CHECKPOINTS = ["never", "except_last", "always"]
WIDTHS = [5, 5, 5, 5, 5]  # 8 modules, equal widths: a weight may be tied to another


class Boom(Exception):
    """Raised by a loss function on purpose."""


def make(model: nn.Module, schedule: str, checkpoint: str, chunks: int = 4) -> Pipe:
    return Pipe(
        model, balance=[2, 2, 2, 2], devices=["cpu"] * 4, chunks=chunks, schedule=schedule,
        virtual_stages=virtual_for(schedule, 4), checkpoint=checkpoint, graphs=Emulated(),
    )  # fmt: skip


def batch(n: int = 8, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, WIDTHS[0], dtype=torch.float64, generator=g)
    return x, torch.randn(n, WIDTHS[-1], dtype=torch.float64, generator=g)


def same_grads(pipe: nn.Module, ref: nn.Module, what: str) -> None:
    """Every parameter's ``.grad`` equal, None where the plain model's is."""
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, f"{what}: {name} has a gradient the plain model lacks"
        else:
            assert p.grad is not None, f"{what}: {name} has no gradient"
            torch.testing.assert_close(p.grad, q.grad, msg=f"{what}: gradient of {name}")


Op = Callable[[Pipe, nn.Module], None]


def loop(n: int = 8, seed: int = 0) -> Op:
    def op(pipe: Pipe, ref: nn.Module) -> None:
        x, y = batch(n, seed)
        out = pipe(x)
        want = ref(x)
        torch.testing.assert_close(out, want)
        nn.functional.mse_loss(out, y).backward()
        nn.functional.mse_loss(want, y).backward()

    return op


def step(n: int = 8, seed: int = 0) -> Op:
    def op(pipe: Pipe, ref: nn.Module) -> None:
        x, y = batch(n, seed)
        got = pipe.train_step(x, y, nn.MSELoss())
        want = nn.functional.mse_loss(ref(x), y)
        want.backward()
        torch.testing.assert_close(got, want.detach())

    return op


def failed_step(at: int = 2) -> Op:
    """A step whose loss raises at micro-batch ``at``: nothing of it stays."""

    def op(pipe: Pipe, ref: nn.Module) -> None:
        x, y = batch(8, 1)
        calls = [0]

        def loss(out: Tensor, target: Tensor) -> Tensor:
            calls[0] += 1
            if calls[0] == at:
                raise Boom
            return nn.functional.mse_loss(out, target)

        with pytest.raises(Boom):
            pipe.train_step(x, y, loss)

    return op


def failed_backward(pipe: Pipe, ref: nn.Module) -> None:
    """A user's backward that raises midway (a hook on the pipe's output):
    what autograd accumulated before stays in both; here nothing was."""
    x, y = batch(8, 2)
    out = pipe(x)

    def boom(g: Tensor) -> Tensor:
        raise Boom

    out.register_hook(boom)
    with pytest.raises(Boom):
        nn.functional.mse_loss(out, y).backward()


def two_passes(pipe: Pipe, ref: nn.Module) -> None:
    """Two forwards, then a backward each (the later one first)."""
    (x1, y1), (x2, y2) = batch(8, 3), batch(8, 4)
    outs = [(m(x1), m(x2)) for m in (pipe, ref)]
    for a, b in outs:
        nn.functional.mse_loss(b, y2).backward()
        nn.functional.mse_loss(a, y1).backward()


def input_grad(pipe: Pipe, ref: nn.Module) -> None:
    """``torch.autograd.grad`` to the input: no ``.grad`` changes."""
    x, y = batch(8, 5)
    got = []
    for m in (pipe, ref):
        xr = x.clone().requires_grad_()
        got.append(torch.autograd.grad(nn.functional.mse_loss(m(xr), y), [xr])[0])
    torch.testing.assert_close(got[0], got[1])


def backward_inputs(pipe: Pipe, ref: nn.Module) -> None:
    """``backward(inputs=[x])``: no parameter's ``.grad`` changes."""
    x, y = batch(8, 6)
    got = []
    for m in (pipe, ref):
        xr = x.clone().requires_grad_()
        nn.functional.mse_loss(m(xr), y).backward(inputs=[xr])
        got.append(xr.grad)
    torch.testing.assert_close(got[0], got[1])


def zero(set_to_none: bool) -> Op:
    def op(pipe: Pipe, ref: nn.Module) -> None:
        pipe.zero_grad(set_to_none=set_to_none)
        ref.zero_grad(set_to_none=set_to_none)

    return op


def frozen(layer: int, flag: bool) -> Op:
    def op(pipe: Pipe, ref: nn.Module) -> None:
        for m in (pipe, ref):
            params = list(m.parameters())
            for p in params[2 * layer : 2 * layer + 2]:
                p.requires_grad_(not flag)

    return op


def no_grad(pipe: Pipe, ref: nn.Module) -> None:
    x, _ = batch(6, 7)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), ref(x))


def mode(training: bool) -> Op:
    def op(pipe: Pipe, ref: nn.Module) -> None:
        pipe.train(training)
        ref.train(training)

    return op


SEQUENCES: dict[str, Sequence[Op]] = {
    "loop_step_alternate": [
        step(), loop(), loop(seed=1), zero(False), step(seed=2), loop(), zero(True),
        loop(), step(), step(seed=3),
    ],
    "autograd_grad_between": [
        loop(), input_grad, loop(seed=1), backward_inputs, step(), input_grad, step(),
        zero(True), input_grad, loop(), backward_inputs, loop(),
    ],
    "frozen_and_rekeyed": [
        step(), loop(), no_grad, frozen(1, True), step(), loop(n=6), frozen(1, False),
        loop(), step(n=6), zero(True), frozen(3, True), loop(), mode(False), loop(),
        mode(True), frozen(3, False), step(), loop(),
    ],
    "failures_between": [
        step(), failed_step(), step(seed=1), failed_backward, loop(), failed_step(1),
        zero(True), failed_step(3), loop(seed=2), step(), failed_backward, zero(True),
        failed_backward, step(), loop(),
    ],
    "two_passes_per_step": [
        two_passes, step(), two_passes, zero(True), two_passes, input_grad, two_passes,
        zero(False), step(), two_passes,
    ],
}  # fmt: skip


def play(ops: Sequence[Op], pipe: Pipe, ref: nn.Module) -> None:
    for i, op in enumerate(ops):
        op(pipe, ref)
        same_grads(pipe, ref, f"after op {i} ({getattr(op, '__qualname__', op)})")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("sequence", SEQUENCES)
def test_a_sequence_of_calls_equals_the_plain_model(
    sequence: str, checkpoint: str, schedule: str
) -> None:
    model = mlp(WIDTHS)
    ref = copy.deepcopy(model)
    play(SEQUENCES[sequence], make(copy.deepcopy(model), schedule, checkpoint), ref)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_a_weight_tied_across_stages_over_a_sequence(checkpoint: str, schedule: str) -> None:
    model = mlp(WIDTHS)
    model[6].weight = model[0].weight
    ref = copy.deepcopy(model)
    ops = [*SEQUENCES["loop_step_alternate"], *SEQUENCES["autograd_grad_between"]]
    play(ops, make(copy.deepcopy(model), schedule, checkpoint), ref)


class Both(nn.Module):
    """Two pipes over one module, summed: the plain model twice."""

    def __init__(self, a: nn.Module, b: nn.Module) -> None:
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x) + self.b(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1", "interleaved_1f1b"])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_two_pipes_over_one_module_over_a_sequence(checkpoint: str, schedule: str) -> None:
    model = mlp(WIDTHS)
    ref = copy.deepcopy(model)
    shared = copy.deepcopy(model)
    a = make(shared, schedule, checkpoint)
    b = make(shared, "gpipe" if schedule != "gpipe" else "1f1b", checkpoint, chunks=2)
    assert list(a.parameters())[0] is list(b.parameters())[0]
    both, twice = Both(a, b), Both(ref, ref)
    ops: list[Callable[[], None]] = []

    def each(op: Op, first: nn.Module, second: nn.Module) -> Callable[[], None]:
        return lambda: op(first, second)  # type: ignore[arg-type]

    for op in [step(), loop(), zero(True), loop(seed=1), input_grad, step(seed=2)]:
        ops += [each(op, a, ref), each(op, b, ref)]
    ops += [each(loop(), both, twice), each(zero(False), both, twice)]  # type: ignore[arg-type]
    ops += [each(loop(seed=3), both, twice), each(step(), a, ref)]  # type: ignore[arg-type]
    for i, run in enumerate(ops):
        run()
        same_grads(a, ref, f"after op {i}")


def _hooked(pipe: Pipe, how: str) -> dict[str, list[Tensor | None]]:
    """Post-accumulate hooks on every parameter that see ``.grad`` and then
    take it away (None), replace it (another tensor of its value) or zero it."""
    seen: dict[str, list[Tensor | None]] = {}
    for name, p in pipe.named_parameters():

        def hook(p: Tensor, name: str = name) -> None:
            g = p.grad
            seen.setdefault(name, []).append(None if g is None else g.clone())
            if how == "none":
                p.grad = None
            elif how == "other" and g is not None:
                p.grad = g.clone()
            elif how == "zero" and g is not None:
                g.zero_()

        p.register_post_accumulate_grad_hook(hook)
    return seen


@pytest.mark.parametrize("schedule", SCHEDULES)
# The hooks' checks do not depend on recomputation beyond whether there is
# any: two modes keep the suite's time in check.
@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("how", ["none", "other", "zero"])
def test_hooks_that_take_grad_away_over_a_sequence_equal_the_eager_pipe(
    how: str, checkpoint: str, schedule: str
) -> None:
    model = mlp(WIDTHS)
    eager, graphed = (
        Pipe(
            copy.deepcopy(model), balance=[2, 2, 2, 2], devices=["cpu"] * 4, chunks=4,
            schedule=schedule, virtual_stages=virtual_for(schedule, 4), checkpoint=checkpoint,
            graphs=graphs,
        )
        for graphs in (False, Emulated())
    )  # fmt: skip
    seen = [_hooked(pipe, how) for pipe in (eager, graphed)]
    ops = [step(), loop(), step(seed=1), input_grad, zero(True), loop(seed=2), two_passes]
    ops += [step(n=6), zero(False), step(), loop()]
    plains = [copy.deepcopy(model) for _ in range(2)]  # each pipe's outputs checked on one
    for i, op in enumerate(ops):
        op(eager, plains[0])
        op(graphed, plains[1])
        same_grads(graphed, eager, f"after op {i}")
        assert seen[1].keys() == seen[0].keys()
        for name, got in seen[0].items():
            assert len(seen[1][name]) == len(got), f"after op {i}: hooks of {name}"
            torch.testing.assert_close(seen[1][name], got, msg=f"after op {i}: {name}")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "zbv"])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("at", range(1, 16, 4))  # capture, replays, no_grad and step calls
def test_a_stage_failing_at_any_call_leaves_the_next_calls_equal(
    at: int, checkpoint: str, schedule: str
) -> None:
    # The stage's own error (FailOnce) at its at-th call: inside a capture's
    # eager run or a replay, in a no_grad call, a step or a user's loop; the
    # failed call leaves nothing, the next ones equal the plain model's.
    model = mlp(WIDTHS)
    ref = copy.deepcopy(model)
    layers = list(copy.deepcopy(model))
    pipe = Pipe(
        nn.Sequential(*layers[:2], FailOnce(at), *layers[2:]), balance=[3, 2, 2, 2],
        devices=["cpu"] * 4, chunks=4, schedule=schedule,
        virtual_stages=virtual_for(schedule, 4), checkpoint=checkpoint, graphs=Emulated(),
    )  # fmt: skip
    ops = [no_grad, step(), loop(), step(seed=1), zero(True), loop(), step(n=6), loop()]
    for i, op in enumerate(ops):
        try:
            op(pipe, ref)
        except RuntimeError as exc:
            assert "stage failed" in str(exc)
        for got, want in zip([p.grad for p in pipe.parameters()], ref.parameters()):
            if want.grad is None:
                assert got is None, f"after op {i}"
            else:
                assert got is not None, f"after op {i}"
                torch.testing.assert_close(got, want.grad, msg=f"after op {i}")

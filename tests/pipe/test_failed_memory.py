"""What a failed pipe call keeps alive, and that it does not grow.

Each test follows the storages of the layers' outputs (weak references,
which see a tensor autograd holds without a Python object) through calls
that raise, the exception caught and let go, with no garbage collection:
an eager pipe keeps none of a failed call's activations; a graphed one
keeps, per call, only the activations of its latest forward replay (the
static memory a CUDA graph holds anyway), however many calls fail.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated
from tests.helpers import mlp


class Boom(Exception):
    """The failure the tests raise on purpose."""


def followed(model: nn.Module) -> list[StorageWeakRef]:
    """Weak references to every output storage of ``model``'s layers, from now on."""
    refs: list[StorageWeakRef] = []

    def hook(module: nn.Module, args: object, out: object) -> None:
        if isinstance(out, Tensor):
            refs.append(StorageWeakRef(out.untyped_storage()))  # type: ignore[no-untyped-call]

    for layer in model.modules():
        if not list(layer.children()):
            layer.register_forward_hook(hook)
    return refs


def alive(refs: list[StorageWeakRef]) -> int:
    return sum(not r.expired() for r in refs)  # type: ignore[no-untyped-call]


def build(
    schedule: str, checkpoint: str, graphs: bool
) -> tuple[Pipe, nn.Sequential, list[StorageWeakRef]]:
    model = mlp([4, 4, 4, 3])
    pipe = Pipe(
        model,
        chunks=4,
        balance=[2, 2, 2],
        devices=["cpu"] * 3,
        schedule=schedule,
        checkpoint=checkpoint,
        graphs=Emulated() if graphs else False,
    )
    return pipe, model, followed(model)


def data() -> tuple[Tensor, Tensor]:
    return torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)


def raising_loss(at: int) -> Callable[[Tensor, Tensor], Tensor]:
    """A mean squared error that raises at its call ``at`` (1 for the first)."""
    calls = [0]

    def loss(out: Tensor, target: Tensor) -> Tensor:
        calls[0] += 1
        if calls[0] == at:
            raise Boom
        return ((out - target) ** 2).mean()

    return loss


def fail_step(pipe: Pipe, model: nn.Sequential) -> None:
    """A training step whose loss raises at its second micro-batch."""
    with pytest.raises(Boom):
        pipe.train_step(*data(), raising_loss(2))


def fail_forward(pipe: Pipe, model: nn.Sequential) -> None:
    """``pipe(x)`` whose last stage raises at its third micro-batch."""
    calls = [0]

    def hook(module: nn.Module, args: object, out: object) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise Boom

    handle = model[4].register_forward_hook(hook)
    try:
        with pytest.raises(Boom):
            pipe(data()[0])
    finally:
        handle.remove()


def succeed(pipe: Pipe) -> None:
    x, y = data()
    pipe.train_step(x, y, nn.MSELoss())
    pipe(x).sum().backward()
    pipe.zero_grad()


@pytest.mark.parametrize("fail", [fail_step, fail_forward], ids=["train_step", "forward"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_an_eager_pipe_keeps_nothing_of_a_failed_or_finished_call(
    schedule: str, checkpoint: str, fail: Callable[[Pipe, nn.Sequential], None]
) -> None:
    pipe, model, refs = build(schedule, checkpoint, graphs=False)
    succeed(pipe)
    assert refs and alive(refs) == 0
    for _ in range(3):
        fail(pipe, model)
        assert alive(refs) == 0


@pytest.mark.parametrize("fail", [fail_step, fail_forward], ids=["train_step", "forward"])
@pytest.mark.parametrize("schedule", ["gpipe", "zb_h1"])
def test_failed_calls_of_a_graphed_pipe_hold_one_replay_per_call_however_many(
    schedule: str, fail: Callable[[Pipe, nn.Sequential], None]
) -> None:
    pipe, model, refs = build(schedule, "never", graphs=True)
    succeed(pipe)
    captures = [s.captures for s in pipe.graph_report().stages]
    assert alive(refs) == 0
    fail(pipe, model)
    held = alive(refs)
    assert held > 0  # the calls' latest replays: what their graphs' pools hold
    for _ in range(4):
        fail(pipe, model)
    assert alive(refs) == held
    assert [s.captures for s in pipe.graph_report().stages] == captures
    succeed(pipe)  # replays every call again, each backward letting its activations go
    assert alive(refs) == 0


def test_failed_backwards_of_a_graphed_pipe_capture_a_bounded_number_of_calls() -> None:
    # A backward that raises leaves the rest of its graph in autograd's ready
    # queue until the next backward drains it (plain PyTorch does the same):
    # the next forward finds those calls still awaiting their backward and
    # captures one more generation of them, and no more after that.
    pipe, model, refs = build("gpipe", "never", graphs=True)
    succeed(pipe)

    def fail_backward() -> None:
        calls = [0]

        def hook(module: nn.Module, grad_in: object, grad_out: object) -> None:
            calls[0] += 1
            if calls[0] == 2:
                raise Boom

        handle = model[2].register_full_backward_hook(hook)
        try:
            with pytest.raises(Boom):
                pipe(data()[0]).sum().backward()
        finally:
            handle.remove()

    for _ in range(3):
        fail_backward()
    captures = [s.captures for s in pipe.graph_report().stages]
    held = alive(refs)
    for _ in range(5):
        fail_backward()
    assert [s.captures for s in pipe.graph_report().stages] == captures
    assert alive(refs) == held

"""Grad and autocast modes a forward sets itself, and buffers it changes:
torch.fx does not record them, so such a module is split by torch.export
(which does), and asking for torch.fx is refused, instead of computing the
block in the caller's mode (a ``torch.no_grad()`` block would carry
gradients) or changing a buffer once while tracing and never again."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from tests.helpers import assert_same_grads


class NoGradShift(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        with torch.no_grad():
            shift = h * 2  # no gradient flows through it in the module
        return self.b(h + shift)  # type: ignore[no-any-return]


class Autocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.b(h)
        return h.float()


class Counting(nn.Module):
    calls: Tensor
    average: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("average", torch.zeros(4))

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        self.average.mul_(0.5).add_(x.mean(0))  # mul_ reads no traced value
        return self.b(self.a(x))  # type: ignore[no-any-return]


@pytest.mark.parametrize("chunks", [1, 3])
def test_a_forward_changing_its_buffers_changes_them_at_each_call(chunks: int) -> None:
    model = Counting().double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=chunks, split_points=["b"], devices=["cpu"] * 2)
    assert model.calls == 0  # splitting ran nothing on the real buffers
    assert pipe.split_report().tracer == "torch.export"
    x = torch.randn(5, 4, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), torch.cat([ref(part) for part in x.chunk(chunks)]))
    torch.testing.assert_close(dict(model.named_buffers()), dict(ref.named_buffers()))
    with pytest.raises(TypeError, match="forward changes buffer.*'calls', 'average'"):
        Pipe(Counting(), split_points=["b"], devices=["cpu"] * 2, tracer="fx")


@pytest.mark.parametrize("chunks", [1, 4])
def test_a_no_grad_block_keeps_its_gradients_out(chunks: int) -> None:
    model = NoGradShift().double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=chunks, split_points=["b"], devices=["cpu"] * 2)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    nn.functional.mse_loss(pipe(x), y).backward()
    nn.functional.mse_loss(ref(x), y).backward()
    assert_same_grads(pipe, ref)
    assert pipe.split_report().tracer == "torch.export"
    for p, q in zip(pipe.parameters(), ref.parameters()):
        p.grad = q.grad = None
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    expected = nn.functional.mse_loss(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize(
    ("model", "mode"), [(NoGradShift, "the grad mode"), (Autocast, "autocast on cpu")]
)
def test_asking_torch_fx_for_a_mode_it_cannot_record_is_refused(model: type, mode: str) -> None:
    with pytest.raises(TypeError, match=f"forward changes {mode} .* torch.fx does not record"):
        Pipe(model(), split_points=["b"], devices=["cpu"] * 2, tracer="fx")


def test_a_forward_setting_autocast_runs_in_it() -> None:
    model = Autocast()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_points=["b"], devices=["cpu"] * 2)
    x = torch.randn(6, 4)
    torch.testing.assert_close(pipe(x), ref(x))


class LazyNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(4, 4), nn.LazyBatchNorm1d(), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.norm(self.a(x)))  # type: ignore[no-any-return]


def test_a_lazy_modules_uninitialised_buffers_are_traced_past() -> None:
    # Their buffers have no values to stand in for; fx never runs the leaf.
    torch.manual_seed(0)
    model = LazyNorm().double()
    torch.manual_seed(0)
    ref = LazyNorm().double()  # a lazy module cannot be deep-copied
    pipe = Pipe(model, split_points=["b"], devices=["cpu"] * 2, tracer="fx")
    x = torch.randn(5, 4, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), ref(x))
    torch.testing.assert_close(dict(model.named_buffers()), dict(ref.named_buffers()))

"""Plain tensor attributes (no buffer) a forward changes or reads.

torch.fx takes such an attribute for a constant: a forward changing it
(``self.calls += 1``) changed the real tensor once, while tracing, and never
again, without an error. A trace now changes a copy and is refused, naming
the attribute; the default tracer then lets torch.export split the module,
which records a change in place (on a copy too: exporting changed the real
tensor once more) and refuses an assignment, which it would drop.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import prune

from mpstream import Pipe
from tests.helpers import assert_same_grads

HOWS = ["+=", "add_", "copy_", "setattr"]


class Counter(nn.Module):
    """Counts its calls in a plain tensor attribute and scales by the count."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.calls = torch.zeros((), dtype=torch.float64)

    def forward(self, h: Tensor) -> Tensor:
        if self.how == "+=":
            self.calls += 1
        elif self.how == "add_":
            self.calls.add_(1)
        elif self.how == "copy_":
            self.calls.copy_(self.calls + 1)
        elif self.how == "setattr":
            setattr(self, "calls", self.calls + 1)  # noqa: B010 - the spelling under test
        return h * self.calls


class Counting(nn.Module):
    """Counts in stage 0 alone, on itself or (``nested``) on a submodule."""

    def __init__(self, how: str, nested: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.inner = Counter(how)
        self.nested = nested
        self.how = how
        self.calls = torch.zeros((), dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        h = self.inner(h) if self.nested else Counter.forward(self, h)  # type: ignore[arg-type]
        return self.b(h)  # type: ignore[no-any-return]


def _counting(how: str, nested: bool) -> Counting:
    torch.manual_seed(0)
    return Counting(how, nested).double()


def _count(model: Counting) -> Tensor:
    return model.inner.calls if model.nested else model.calls


def _name(nested: bool) -> str:
    return "inner.calls" if nested else "calls"


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("how", HOWS)
def test_torch_fx_refuses_a_forward_changing_one_naming_it(how: str, nested: bool) -> None:
    model = _counting(how, nested)
    with pytest.raises(TypeError) as raised:
        Pipe(model, split_points=["b"], devices=["cpu"] * 2, tracer="fx")
    message = str(raised.value)
    assert f"forward changes the tensor attribute(s) '{_name(nested)}' in place" in message
    assert "self.register_buffer('calls', ...)" in message
    assert _count(model) == 0  # the trace changed a copy


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("how", ["+=", "add_", "copy_"])
def test_a_change_in_place_is_made_at_every_call_as_the_model_makes_it(
    how: str, nested: bool
) -> None:
    model = _counting(how, nested)
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=2, split_points=["b"], devices=["cpu"] * 2,
                sample=torch.randn(4, 4, dtype=torch.float64))  # fmt: skip
    assert pipe.split_report().tracer == "torch.export"
    assert _count(model) == 0  # exporting changed a copy
    for _ in range(3):
        x = torch.randn(6, 4, dtype=torch.float64)
        out = pipe(x)
        torch.testing.assert_close(out, torch.cat([ref(part) for part in x.chunk(2)]))
    torch.testing.assert_close(_count(model), _count(ref))


@pytest.mark.parametrize("tracer", ["auto", "export"])
@pytest.mark.parametrize("nested", [False, True])
def test_an_assignment_torch_export_would_drop_is_refused_naming_it(
    tracer: str, nested: bool
) -> None:
    model = _counting("setattr", nested)
    with pytest.raises(TypeError) as raised:
        Pipe(model, split_points=["b"], devices=["cpu"] * 2, tracer=tracer,
             sample=torch.randn(4, 4, dtype=torch.float64))  # fmt: skip
    message = str(raised.value)
    assert f"assigns the tensor attribute '{_name(nested)}', which is no buffer" in message
    assert "self.register_buffer('calls', ...)" in message
    assert _count(model) == 0


class CountingBuffer(nn.Module):
    """The advice taken: the count in a buffer, assigned."""

    calls: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        self.calls = self.calls + 1
        return self.b(self.a(x) * self.calls)  # type: ignore[no-any-return]


def test_the_buffer_advised_counts_every_call() -> None:
    torch.manual_seed(0)
    model = CountingBuffer().double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=2, split_points=["b"], devices=["cpu"] * 2)
    for _ in range(3):
        x = torch.randn(6, 4, dtype=torch.float64)
        torch.testing.assert_close(pipe(x), torch.cat([ref(part) for part in x.chunk(2)]))
    torch.testing.assert_close(model.calls, ref.calls)


class Scaled(nn.Module):
    """Reads a plain tensor attribute in each stage, never changing it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.scale = torch.full((4,), 0.5, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x) * self.scale) * self.scale  # type: ignore[no-any-return]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_one_only_read_is_read_as_the_model_reads_it(tracer: str) -> None:
    torch.manual_seed(0)
    model = Scaled().double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=2, split_points=["b"], devices=["cpu"] * 2, tracer=tracer,
                sample=torch.randn(4, 4, dtype=torch.float64))  # fmt: skip
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    nn.functional.mse_loss(pipe(x), y).backward()
    nn.functional.mse_loss(ref(x), y).backward()
    assert_same_grads(pipe, ref)
    model.scale.fill_(2.0)  # the stages read the model's own tensor
    ref.scale.fill_(2.0)
    torch.testing.assert_close(pipe(x), ref(x))


class Normed(nn.Module):
    """Layers reparametrized by torch.nn.utils' hooks (spectral_norm,
    weight_norm, prune), whose forward pre-hooks assign ``weight`` (a plain
    attribute) from parameters and buffers before each call, and the newer
    parametrization between them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.utils.spectral_norm(nn.Linear(4, 4))
        self.b = nn.utils.parametrizations.weight_norm(nn.Linear(4, 3))
        with pytest.warns(FutureWarning, match="weight_norm"):
            self.c = nn.utils.weight_norm(nn.Linear(3, 3))
        self.d = prune.l1_unstructured(nn.Linear(3, 2), "weight", amount=0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.d(self.c(self.b(torch.relu(self.a(x)))))


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_spectral_norm_weight_norm_and_prune_hooks_export_and_train_as_the_model(mode: str) -> None:
    # Their assignment is dropped by the export, harmlessly: the forward
    # reads the weight it computes. It was refused as a plain attribute's.
    torch.manual_seed(0)
    model = Normed().double()
    torch.manual_seed(0)
    pipe = Pipe(Normed().double(), chunks=2, split_points=["b"], devices=["cpu"] * 2,
                tracer="export")  # fmt: skip
    getattr(model, mode)()
    getattr(pipe, mode)()
    for _ in range(2):  # spectral_norm's power iteration updates buffers u, v per call
        x = torch.randn(4, 4, dtype=torch.float64)
        ref = torch.cat([model(c) for c in x.chunk(2)])
        out = pipe(x)
        torch.testing.assert_close(out, ref)
        ref.sum().backward()
        out.sum().backward()
        assert_same_grads(pipe, model)
        for b, a in zip(pipe.buffers(), model.buffers(), strict=True):
            torch.testing.assert_close(b, a)

"""A None item inside an argument (a batch ``{"x": x, "shift": None}``, a
namedtuple's or a registered dataclass's field, a list's item) makes a kind
of call of its own for torch.fx, as a None argument does: the trace reads
it as None, so ``if batch["shift"] is not None:`` follows the call. Outputs
and gradients equal the plain module's for every kind, in any order."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from mpstream import Pipe
from mpstream.stages.traced import FxSplit
from mpstream.stages.tracers import nones_of


class Pair(NamedTuple):
    x: Tensor
    shift: Tensor | None


@dataclasses.dataclass
class Inner:
    shift: Tensor | None


@dataclasses.dataclass
class Outer:
    x: Tensor
    inner: Inner


pytree.register_dataclass(Inner)
pytree.register_dataclass(Outer)


class Shifted(nn.Module):
    """Adds an optional shift read from inside its one argument."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.read = read
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, batch: Any) -> Tensor:
        if self.read == "dict":
            x, shift = batch["x"], batch["shift"]
        elif self.read == "namedtuple":
            x, shift = batch.x, batch.shift
        elif self.read == "dataclass":
            x, shift = batch.x, batch.inner.shift
        else:
            x, shift = batch[0], batch[1]
        h = torch.tanh(self.a(x))
        if shift is not None:
            h = h * shift
        return self.b(h)


def _batch(read: str, x: Tensor, shift: Tensor | None) -> Any:
    if read == "dict":
        return {"x": x, "shift": shift}
    if read == "namedtuple":
        return Pair(x, shift)
    if read == "dataclass":
        return Outer(x, Inner(shift))
    return [x, shift]


LABELS = {
    "dict": "batch['shift']",
    "namedtuple": "batch.shift",
    "dataclass": "batch.inner.shift",
    "list": "batch[1]",
}


def fx_split(pipe: Pipe) -> FxSplit:
    split = pipe.__dict__["_split"]
    assert isinstance(split, FxSplit)
    return split


@pytest.mark.parametrize("read", list(LABELS))
@pytest.mark.parametrize("split_size", [2, 3])
def test_a_none_item_is_traced_as_none_and_trains_as_the_plain_model(
    read: str, split_size: int
) -> None:
    torch.manual_seed(0)
    model = Shifted(read).double()
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, split_size=split_size
    )
    x = torch.randn(6, 4, dtype=torch.float64)
    s = torch.randn(6, 4, dtype=torch.float64)
    y = torch.randn(6, 2, dtype=torch.float64)
    for shift in [s, None, s, None]:
        batch = _batch(read, x, shift)
        pipe.zero_grad()
        model.zero_grad()
        out = pipe(batch)
        expected = model(batch)
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        for p, q in zip(pipe.parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        pipe.zero_grad()
        model.zero_grad()
        loss = pipe.train_step(batch, y, nn.MSELoss())
        F.mse_loss(model(batch), y).backward()
        torch.testing.assert_close(loss, F.mse_loss(expected, y).detach())
        for p, q in zip(pipe.parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    split = fx_split(pipe)
    assert len(split.traces) == 2  # each kind traced once, then reused
    described = [t.split(": ", 1)[1] for t in pipe.split_report().traces]
    assert described == ["every argument given", f"{LABELS[read]}=None"]


class Unread(nn.Module):
    """A None item the code never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, batch: dict[str, Tensor | None]) -> Tensor:
        return self.b(self.a(batch["x"]))  # type: ignore[arg-type]


def test_a_none_item_the_code_does_not_read_shares_the_split() -> None:
    model = Unread().double()
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    for batch in [{"x": x, "m": x}, {"x": x, "m": None}]:
        torch.testing.assert_close(pipe(batch), model(batch))
    split = fx_split(pipe)
    assert len(split.kinds) == 2 and len(split.traces) == 1


def test_a_sample_with_a_none_item_traces_that_kind_first() -> None:
    model = Shifted("dict").double()
    x = torch.randn(4, 4, dtype=torch.float64)
    batch = {"x": x, "shift": None}
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=2, sample=(batch,)
    )
    torch.testing.assert_close(pipe(batch), model(batch))
    assert len(fx_split(pipe).traces) == 1


def test_nones_of_names_arguments_and_items() -> None:
    x = torch.zeros(1)
    values = {
        "x": x,
        "mask": None,
        "batch": {"a": x, "b": None, "c": [x, None]},
        "pair": Pair(x, None),
        "outer": Outer(x, Inner(None)),
        "n": 3,
        "empty": {},
    }
    assert nones_of(values) == {
        "mask",
        "batch['b']",
        "batch['c'][1]",
        "pair.shift",
        "outer.inner.shift",
    }


class ReadAs(nn.Module):
    """Reads ``x`` and an optional shift from its one argument with ``read``."""

    def __init__(self, read: Any) -> None:
        super().__init__()
        self.read = read
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, batch: Any) -> Tensor:
        x, shift = self.read(batch)
        h = torch.tanh(self.a(x))
        if shift is not None:
            h = h * shift
        return self.b(h)


def _assert_each_kind_as_the_plain_model(model: nn.Module, make: Any) -> None:
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    s = torch.randn(4, 4, dtype=torch.float64)
    for shift in [s, None, s, None]:
        batch = make(x, shift)
        pipe.zero_grad()
        model.zero_grad()
        out, expected = pipe(batch), model(batch)
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        for p, q in zip(pipe.parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    assert len(fx_split(pipe).traces) == 2


@pytest.mark.parametrize(
    "make, read",
    [
        (lambda x, s: Pair(x, s), lambda b: (b[0], b[1])),  # a namedtuple by index
        (lambda x, s: Pair(x, s), lambda b: (b.x, b[-1])),
        (lambda x, s: [x, [s]], lambda b: (b[0], b[-1][-1])),  # from the end
        (lambda x, s: [x, s, x], lambda b: (b[0], b[1:][0])),  # a slice's item
        (lambda x, s: Pair(x, s), lambda b: (b[0], b[::-1][0])),
        (lambda x, s: [x, [x, s]], lambda b: (b[0], b[-1:][0][1:][-1])),
    ],
    ids=[
        "namedtuple-index",
        "namedtuple-negative",
        "list-negative",
        "list-slice",
        "namedtuple-reversed",
        "nested-slices",
    ],
)
def test_a_none_item_read_by_another_name_is_traced_as_none(make: Any, read: Any) -> None:
    torch.manual_seed(0)
    _assert_each_kind_as_the_plain_model(ReadAs(read).double(), make)


def test_a_sample_whose_none_item_is_read_by_index_balances_and_traces_that_kind() -> None:
    model = ReadAs(lambda b: (b[0], b[1])).double()
    batch = Pair(torch.randn(4, 4, dtype=torch.float64), None)
    pipe = Pipe(
        copy.deepcopy(model), balance="time", devices=["cpu"] * 2, chunks=2, sample=(batch,)
    )
    torch.testing.assert_close(pipe(batch), model(batch))
    assert [t.described for t in fx_split(pipe).traces] == ["training: batch.shift=None"]


@pytest.mark.parametrize(
    "make, read",
    [
        (lambda x, s: {"x": x, ("s", 1): s}, lambda b: (b["x"], b[("s", 1)])),
        (lambda x, s: {"x": x, "s": s}, lambda b: (b.get("x"), b.get("s", 1.0))),
    ],
    ids=["tuple-key", "get"],
)
def test_a_none_item_under_any_key_or_read_with_get_is_traced_as_none(make: Any, read: Any) -> None:
    torch.manual_seed(0)
    _assert_each_kind_as_the_plain_model(ReadAs(read).double(), make)


def test_lists_whose_none_item_ends_one_and_not_the_other_are_two_kinds() -> None:
    """``batch[-1]`` is None in ``[x, None]``, not in ``[x, None, s]``."""
    torch.manual_seed(0)
    model = ReadAs(lambda b: (b[0], b[-1])).double()
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    s = torch.randn(4, 4, dtype=torch.float64)
    for batch in [[x, None], [x, None, s], [x, None]]:
        torch.testing.assert_close(pipe(batch), model(batch))
    described = [t.described for t in fx_split(pipe).traces]
    assert described == ["training: every argument given", "training: batch[1]=None"]

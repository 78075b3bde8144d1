"""Which memory a change in place reaches (mpstream/stages/inplace_paths.py):
the items of a structure and a namedtuple's fields are memories of their
own, a leaf module's result and an index that may read a tensor are one
memory, and torch calls returning namedtuples have their fields by name and
by index."""

from __future__ import annotations

import re

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from tests.stages.inplace_helpers import Batch, Odd, runs_as_the_module


def _refused(model: nn.Module, leaf: type[nn.Module], changed: str) -> None:
    """A pipe of ``model`` split at ``b`` and ``c`` (``leaf`` kept whole) is
    refused: stage 1's ``mul_`` changes ``changed``, which stage 2 reads."""
    refused = re.escape(f"'mul_' in stage 1 changes {changed} in place, which stage 2")
    with pytest.raises(ValueError, match=refused):
        Pipe(model, chunks=2, split_points=["b", "c"], devices=["cpu"] * 3, leaf_modules=[leaf])


class Pair(nn.Module):
    """A leaf module returning a namedtuple."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Batch:
        return Batch(self.lin(x), self.lin(x) * 2)


class ChangesAField(nn.Module):
    """Stage 1 changes ``out.x`` of stage 0's namedtuple in place; stage 2 reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.pair, self.b, self.c = Pair(), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        out = self.pair(x)
        g = self.b(x)
        out.x.mul_(2)
        return self.c(out.x) + g  # type: ignore[no-any-return]


def test_a_change_of_another_stage_s_namedtuple_field_is_refused() -> None:
    # It was let through: stage 2 read ``out.x`` as stage 0 made it, unchanged.
    _refused(ChangesAField(), Pair, "pair.x")


class ChangesOneItem(nn.Module):
    """Stage 1 changes ``batch["x"]`` in place; stage 2 reads ``batch["m"]``,
    or ``batch["x"]`` itself (``reads="x"``)."""

    def __init__(self, reads: str = "m") -> None:
        super().__init__()
        self.reads = reads
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        h = self.a(batch["m"])
        g = self.b(h)
        batch["x"].mul_(2)
        g = g + batch["x"]
        return self.c(g) * batch[self.reads]  # type: ignore[no-any-return]


def test_a_change_of_one_item_of_a_dict_input_leaves_the_others_to_later_stages() -> None:
    # It was refused as a change of 'batch', though stage 2 reads only batch["m"].
    batch = {k: torch.randn(6, 4, dtype=torch.float64) for k in ("x", "m")}
    runs_as_the_module(ChangesOneItem(), batch, "fx")
    refused = r"changes batch\['x'\] in place, which stage 2"
    with pytest.raises(ValueError, match=refused):
        Pipe(ChangesOneItem("x"), chunks=2, split_points=["b", "c"], devices=["cpu"] * 3,
             tracer="fx")  # fmt: skip


class AliasedPair(nn.Module):
    """A leaf module returning a namedtuple whose ``y`` is a view of its ``x``
    (as a model output's ``last_hidden_state`` is its ``hidden_states[-1]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Batch:
        h = self.lin(x)
        return Batch(h, h.view(-1, 4))


class ChangesOtherField(nn.Module):
    """Stage 1 changes ``out.x`` of stage 0's namedtuple in place; stage 2 reads ``out.y``."""

    def __init__(self, pair: nn.Module) -> None:
        super().__init__()
        self.pair, self.b, self.c = pair, nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        out = self.pair(x)
        g = self.b(x)
        out.x.mul_(2)
        g = g + out.x
        return self.c(out.y) + g  # type: ignore[no-any-return]


@pytest.mark.parametrize("leaf", [Pair, AliasedPair])
def test_a_change_of_one_field_of_a_leaf_s_result_is_refused(leaf: type[nn.Module]) -> None:
    # A leaf's fields were memories of their own: AliasedPair's was let through, and
    # across devices stage 2 would read out.y, a view of out.x, unchanged.
    _refused(ChangesOtherField(leaf()), leaf, "pair.x")


class ChangesOneResult(nn.Module):
    """Stage 1 changes ``values`` of stage 0's ``torch.sort`` in place;
    stage 2 reads ``indices``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        values, indices = torch.sort(self.a(x), 1)
        g = self.b(values + 0.0)
        values.mul_(2)
        return self.c(g + values) * indices  # type: ignore[no-any-return]


def test_a_change_of_one_result_of_a_tuple_leaves_the_others_to_later_stages() -> None:
    # torch.export records the tuple: its items are told apart by index.
    runs_as_the_module(ChangesOneResult(), torch.randn(6, 4, dtype=torch.float64), "export")


class Both(nn.Module):
    """A leaf module returning a plain tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.lin(x), self.lin(x) * 2


class ChangesByIndex(nn.Module):
    """Stage 1 changes ``out[0]`` in place, ``out`` a tuple of stage 0 or
    (``tensor=True``) a tensor; stage 2 reads ``out[-1]``."""

    def __init__(self, tensor: bool) -> None:
        super().__init__()
        self.tensor = tensor
        self.both, self.b, self.c = Both(), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        out = self.both(x)[0] if self.tensor else self.both(x)
        g = self.b(x)
        out[0].mul_(2)
        return self.c(g) * out[-1]  # type: ignore[no-any-return]


@pytest.mark.parametrize("tensor", [False, True])
def test_an_index_that_may_read_a_tensor_stays_one_memory(tensor: bool) -> None:
    # fx cannot tell a leaf's tuple from a tensor, and x[-1] of a tensor may be x[0].
    _refused(ChangesByIndex(tensor), Both, "both[0][0]" if tensor else "both[0]")


class OddPair(nn.Module):
    """A leaf module returning an :class:`Odd`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Odd:
        return Odd(self.lin(x), self.lin(x) * 2, self.lin(x) * 3)


class ChangesAnOddField(nn.Module):
    """Stage 1 changes stage 0's ``out.grad`` or ``out.shape`` in place; stage 2 reads it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.pair, self.b, self.c = OddPair(), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        out = self.pair(x)
        g = self.b(out.x)
        getattr(out, self.name).mul_(2)
        return self.c(g) * getattr(out, self.name)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", ["grad", "shape"])
def test_a_change_of_a_field_named_as_a_tensor_attribute_is_refused(name: str) -> None:
    # out.grad was taken for a tensor's grad, out.shape for a size: the change was let
    # through, and stage 2 read the field as stage 0 made it.
    _refused(ChangesAnOddField(name), OddPair, f"pair.{name}")


# Torch calls returning a namedtuple of tensors, and its two fields' names.
RESULTS = {
    "max": (lambda h: torch.max(h, 1), ("values", "indices")),
    "sort": (lambda h: h.sort(1), ("values", "indices")),
    "topk": (lambda h: torch.topk(h, 2), ("values", "indices")),
    "kthvalue": (lambda h: torch.kthvalue(h, 2, 1), ("values", "indices")),
    "median": (lambda h: h.median(1), ("values", "indices")),
    "aminmax": (lambda h: torch.aminmax(h, dim=1), ("min", "max")),
}


class ChangesAResultField(nn.Module):
    """Stage 1 changes the first field of stage 0's namedtuple result (``m.values``,
    or ``m[0]`` where ``by="index"``) in place; stage 2 reads field ``read`` (a name
    or an index)."""

    def __init__(self, op: str, by: str, read: str | int) -> None:
        super().__init__()
        self.op, self.by, self.read = op, by, read
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        call, names = RESULTS[self.op]
        m = call(self.a(x))
        g = self.b(x)
        v = getattr(m, names[0]) if self.by == "name" else m[0]
        v.mul_(2)
        out = self.c(g + v.reshape(v.shape[0], -1).sum(1, keepdim=True))
        r = m[self.read] if isinstance(self.read, int) else getattr(m, self.read)
        return out * r.reshape(r.shape[0], -1).sum(1, keepdim=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize("op", list(RESULTS))
@pytest.mark.parametrize("by", ["name", "index"])
@pytest.mark.parametrize("read", ["name", "index"])
def test_a_change_of_a_result_s_field_by_name_or_index_is_refused(
    op: str, by: str, read: str
) -> None:
    # m.values was a memory of its own: changed in stage 1, stage 2 read it
    # (as m.values or m[0]) as stage 0 made it.
    first = RESULTS[op][1][0] if read == "name" else 0
    refused = r"'mul_' in stage 1 changes \w+(\.\w+|\[0\]) in place, which stage 2 also reads"
    with pytest.raises(ValueError, match=refused):
        Pipe(ChangesAResultField(op, by, first), chunks=2, split_points=["b", "c"],
             devices=["cpu"] * 3, tracer="fx")  # fmt: skip


# aminmax's backward reads both its results: a change of one fails the module's too.
@pytest.mark.parametrize("op", [op for op in RESULTS if op != "aminmax"])
@pytest.mark.parametrize("by", ["name", "index"])
@pytest.mark.parametrize("read", ["name", "index"])
@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_change_of_one_field_of_a_result_leaves_the_other_to_later_stages(
    op: str, by: str, read: str, tracer: str
) -> None:
    # m[0] was a view of all of m: a later stage's m.indices (or m[1]) was refused.
    second = RESULTS[op][1][1] if read == "name" else 1
    model = ChangesAResultField(op, by, second)
    runs_as_the_module(model, torch.randn(6, 4, dtype=torch.float64), tracer)


class ChangesVh(nn.Module):
    """Stage 1 changes ``Vh`` of stage 0's ``torch.linalg.svd`` in place;
    stage 2 reads ``U`` by index."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        r = torch.linalg.svd(self.a(x).reshape(-1, 2, 2))
        g = self.b(x)
        r.Vh.mul_(2)
        out = self.c(g + r.Vh.reshape(-1, 4))
        return out * r[0].reshape(-1, 4)  # type: ignore[no-any-return]


def test_torch_linalg_s_result_has_its_own_fields() -> None:
    # torch.svd's fields (V, not Vh) were taken for torch.linalg.svd's: r.Vh
    # was no field by index, so r[0] in stage 2 was refused as maybe r.Vh.
    model = ChangesVh().double()
    pipe = Pipe(model, chunks=2, split_points=["b", "c"], devices=["cpu"] * 3, tracer="fx")
    x = torch.randn(6, 4, dtype=torch.float64)
    with torch.no_grad():  # svd's backward reads the Vh changed, in the module too
        torch.testing.assert_close(pipe(x), model(x))

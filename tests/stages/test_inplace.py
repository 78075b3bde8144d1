"""In-place changes across a split: a change through a view of another
stage's value, by either tracer, is refused at the split instead of giving
later stages (and the gradients) the value unchanged."""

from __future__ import annotations

import copy
import dataclasses
import types
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from mpstream import Pipe
from tests.helpers import Ops, assert_same_grads


class ThroughView(nn.Module):
    """Stage 1 changes ``h``, made in stage 0, through a view; ``c`` reads it."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x) + 1.0
        g = self.b(h + 1.0)
        if self.how == "slice":
            h[:, :2].mul_(2)
        elif self.how == "view":
            h.view(-1).mul_(2)
        else:
            h[:, 0] = 0.0  # torch.fx cannot trace this: torch.export splits it
        return self.c(h) + g  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["slice", "view", "setitem"])
def test_a_change_through_a_view_another_stage_would_miss_is_refused(how: str) -> None:
    x = torch.randn(6, 4)
    with pytest.raises(ValueError, match="in stage 1 changes 'add' in place, which stage 2"):
        pipe = Pipe(ThroughView(how), chunks=2, split_points=["b", "c"], devices=["cpu"] * 3)
        pipe(x)  # a module split by torch.export is split at its first call


@pytest.mark.parametrize("how", ["slice", "setitem"])
def test_a_change_through_a_view_in_the_stage_that_makes_it_trains(how: str) -> None:
    model = ThroughView(how).double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=4, split_points=["c"], devices=["cpu"] * 2)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    expected = nn.functional.mse_loss(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)


class ApartView(nn.Module):
    """Stage 1 changes ``h``, made in stage 0, and reads ``v``, a view of
    ``h`` that stage 0 made and passes on its own (a copy of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(2, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        v = h[:, :2]
        g = self.b(x[:, :2])
        h.mul_(2)
        return g * self.b(v)  # type: ignore[no-any-return]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_change_the_same_stage_reads_through_a_view_passed_apart_is_refused(
    tracer: str,
) -> None:
    # With copies between the stages (as across devices) ``v`` reached stage 1 unchanged.
    with pytest.raises(ValueError, match=r"in stage 1 changes '\w+' in place, which stage 1"):
        pipe = Pipe(ApartView(), chunks=2, split_points=["b"], devices=["cpu"] * 2,
                    force_copies=True, tracer=tracer)  # fmt: skip
        pipe(torch.randn(6, 4))  # a module split by torch.export is split at its first call


class ViewAround(nn.Module):
    """Stage 1 changes ``h``, made in stage 0, in place; ``c`` in stage 2
    reads ``v``, a view of ``h`` taken where ``where`` says."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(2, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        v = h[:, :2] if self.where == "stage 0" else h
        g = self.b(x)
        v = h[:, :2] if self.where == "stage 1, before" else v
        h.mul_(2)
        v = h[:, :2] if self.where == "stage 1, after" else v
        y = self.c(g[:, 2:])
        v = h[:, :2] if self.where == "stage 2" else v
        return self.c(v) + y  # type: ignore[no-any-return]


@pytest.mark.parametrize(("tracer", "where"), [("fx", "stage 1, after"), ("fx", "stage 1, before"),
                                               ("export", "stage 1, before")])  # fmt: skip
def test_a_view_the_changing_stage_takes_carries_the_change(tracer: str, where: str) -> None:
    # It was refused ("stage 2 also reads 'a'"): stage 1 passes ``v`` changed.
    model = ViewAround(where).double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=2, split_points=["b", "c"], devices=["cpu"] * 3, tracer=tracer,
                force_copies=True)  # fmt: skip
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    expected = nn.functional.mse_loss(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize(("where", "reads"), [("stage 0", " through its view 'getitem'"),
                                              ("stage 2", "")])  # fmt: skip
def test_a_view_of_the_value_before_the_change_is_refused(where: str, reads: str) -> None:
    # Taken in stage 0, or in stage 2 of ``h`` as stage 0 passes it: unchanged.
    with pytest.raises(ValueError, match=f"'mul_' in stage 1 changes 'a' in place, which "
                                         f"stage 2 also reads{reads}:"):  # fmt: skip
        Pipe(ViewAround(where), chunks=2, split_points=["b", "c"], devices=["cpu"] * 3)


class ChangedAgain(nn.Module):
    """Stage 1 takes ``v`` of ``h`` and changes ``h``; stage 2 changes ``h``
    again, through the result of the first change, then reads ``v``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(2, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        g = self.b(x)
        v = h[:, :2]
        h *= 2
        y = self.c(g[:, 2:])
        h += 1
        return self.c(v) + y  # type: ignore[no-any-return]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_view_passed_before_a_later_change_of_the_changed_result_is_refused(tracer: str) -> None:
    # ``v`` carries stage 1's change of ``h``, not ``h += 1``, which changes ``h``
    # too: ``h *= 2``'s result is ``h``, not a value of its own.
    apart = r"in stage 2 changes '\w+' in place, which stage 2 also reads through '\w+', which"
    with pytest.raises(ValueError, match=apart):
        pipe = Pipe(ChangedAgain(), chunks=2, split_points=["b", "c"], devices=["cpu"] * 3,
                    tracer=tracer)  # fmt: skip
        pipe(torch.randn(6, 4))  # a module split by torch.export is split at its first call


def _trains_as_the_module(model: nn.Module, batch: Any, tracer: str) -> tuple[Pipe, nn.Module]:
    """A 2-stage pipe of ``model`` (split at ``b``, 3 micro-batches of 7 rows)
    trains as ``model`` given a copy of ``batch``, and leaves ``batch`` as it was."""
    model = model.double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=3, split_points=["b"], devices=["cpu"] * 2, tracer=tracer)
    given = pytree.tree_map_only(Tensor, torch.clone, batch)
    y = torch.randn(7, 4, dtype=torch.float64)
    loss = pipe.train_step(batch, y, nn.functional.mse_loss)
    expected = nn.functional.mse_loss(ref(pytree.tree_map_only(Tensor, torch.clone, given)), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)
    torch.testing.assert_close(batch, given, rtol=0, atol=0)  # the caller's batch: left as it was
    return pipe, ref


def _clones_per_call(model: nn.Module, batch: Any) -> int:
    """Checks that a torch.fx pipe of ``model`` trains as ``model``
    (:func:`_trains_as_the_module`); the tensors it copies in one call on ``batch``."""
    pipe, _ = _trains_as_the_module(model, batch, "fx")
    with Ops() as ops:
        pipe(batch)
    return ops.ops["clone"]


def _refused(model: nn.Module, leaf: type[nn.Module], changed: str) -> None:
    """A pipe of ``model`` split at ``b`` and ``c`` (``leaf`` kept whole) is
    refused: stage 1's ``mul_`` changes ``changed``, which stage 2 reads."""
    refused = f"'mul_' in stage 1 changes '{changed}' in place, which stage 2"
    with pytest.raises(ValueError, match=refused):
        Pipe(model, chunks=2, split_points=["b", "c"], devices=["cpu"] * 3, leaf_modules=[leaf])


class ChangesInput(nn.Module):
    """Changes its input in place, where stage 0 begins; stage 1 reads it too."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        if self.how == "method":
            x.div_(2)
        else:
            x[:, 0] = 0.0  # torch.fx cannot trace this: torch.export splits it
        return self.b(self.a(x)) + x  # type: ignore[no-any-return]


@pytest.mark.parametrize(("tracer", "how"), [("fx", "method"), ("export", "method"),
                                             ("export", "setitem")])  # fmt: skip
def test_an_input_changed_in_place_trains_per_micro_batch(tracer: str, how: str) -> None:
    # Micro-batches of one input share its version counter: each micro-batch's
    # change failed the backward of the ones before, which saved theirs.
    x = torch.randn(7, 4, dtype=torch.float64)
    pipe, ref = _trains_as_the_module(ChangesInput(how), x, tracer)
    torch.testing.assert_close(pipe(x), ref(x.clone()))


class ChangesDictInput(nn.Module):
    """Changes a tensor of its dict batch in place; stage 1 reads the dict too."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        batch["x"].mul_(2)
        return self.b(self.a(batch["x"])) + batch["y"]  # type: ignore[no-any-return]


def test_a_dict_input_changed_in_place_gets_a_copy_of_its_tensors() -> None:
    # torch.fx keeps a dict batch one input: torch.clone of it raised TypeError.
    batch = {k: torch.randn(7, 4, dtype=torch.float64) for k in ("x", "y")}
    _trains_as_the_module(ChangesDictInput(), batch, "fx")


class ChangesNestedInput(nn.Module):
    """Changes ``batch["in"]["x"]`` in place, once through a view."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: dict[str, Any]) -> Tensor:
        x = batch["in"]["x"]
        x[:, 0].add_(1)
        x.mul_(2)
        return self.b(self.a(x)) + batch["y"] + batch["in"]["z"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("model", [ChangesDictInput, ChangesNestedInput])
def test_a_structured_input_gets_a_copy_of_the_changed_tensor_alone(model: type[nn.Module]) -> None:
    # Every tensor of the batch was copied per micro-batch, batch["y"] too.
    x, y, z = (torch.randn(7, 4, dtype=torch.float64) for _ in range(3))
    batch = {"x": x, "y": y} if model is ChangesDictInput else {"in": {"x": x, "z": z}, "y": y}
    assert _clones_per_call(model(), batch) == 3  # one of the changed tensor per micro-batch


class Batch(NamedTuple):
    x: Tensor
    y: Tensor


class ChangesNamedTupleInput(nn.Module):
    """Changes ``batch.x`` of its namedtuple batch in place, read by field."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: Batch) -> Tensor:
        batch.x.mul_(2)
        return self.b(self.a(batch.x)) + batch.y  # type: ignore[no-any-return]


def test_a_namedtuple_input_changed_through_a_field_gets_a_copy_of_it() -> None:
    # ``batch.x`` was not seen as the input's: no copy, so the micro-batches'
    # changes failed each other's backward, and the caller's batch changed.
    batch = Batch(*(torch.randn(7, 4, dtype=torch.float64) for _ in range(2)))
    model = ChangesNamedTupleInput()
    assert _clones_per_call(model, batch) == 3  # of batch.x alone, per micro-batch
    _trains_as_the_module(ChangesNamedTupleInput(), batch, "export")


@dataclasses.dataclass
class DataBatch:
    x: Tensor
    y: Tensor


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("kind", [DataBatch, types.SimpleNamespace])
@pytest.mark.parametrize("path", ["forward", "train_step"])
def test_an_object_input_pytree_does_not_flatten_is_refused_by_name(
    tracer: str, kind: Any, path: str
) -> None:
    # Neither split into micro-batches nor copied where the forward changes
    # batch.x: torch.fx's split was refused by the scatter ("input holds a
    # DataBatch") without naming the input or what to do, torch.export's
    # export failed, blaming data-dependent control flow.
    model = ChangesNamedTupleInput().double()
    pipe = Pipe(model, chunks=3, split_points=["b"], devices=["cpu"] * 2, tracer=tracer)
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    batch, before = kind(x=x, y=y), x.clone()
    refused = rf"Pipe input batch is a {kind.__name__} holding tensors \(x, y\).*namedtuple"
    with pytest.raises(TypeError, match=refused):
        if path == "forward":
            pipe(batch)
        else:
            pipe.train_step(batch, torch.zeros(7, 4, dtype=torch.float64), nn.functional.mse_loss)
    torch.testing.assert_close(batch.x, before, rtol=0, atol=0)  # refused before anything ran
    assert all(p.grad is None for p in pipe.parameters())
    # What the message advises computes what the module does.
    _trains_as_the_module(ChangesNamedTupleInput(), Batch(x, y), tracer)


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
    _refused(ChangesAField(), Pair, "pair")


class AugmentsInput(nn.Module):
    """``x += 1`` changes the input in place, so ``v``, a view of it taken before."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        v = x[:, :2]
        x += 1
        return self.b(self.a(torch.cat([v, x], 1)))  # type: ignore[no-any-return]


def test_an_augmented_assignment_to_an_input_changes_its_views() -> None:
    # Traced as ``x = x + 1`` for an input, ``v`` was left unchanged: another result.
    _trains_as_the_module(AugmentsInput(), torch.randn(7, 4, dtype=torch.float64), "fx")


class ChangesInputLater(nn.Module):
    """Stage 1 changes the input in place; stages 0 and 2 read it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.b(self.a(x))
        x.mul_(2)
        return self.c(h) + x  # type: ignore[no-any-return]


def test_a_refused_change_of_an_input_names_the_input() -> None:
    # It named the copy copy_changed_inputs gives the input ('clone'), not the input.
    with pytest.raises(ValueError, match="'mul_' in stage 1 changes 'x' in place, which stage 2"):
        Pipe(ChangesInputLater(), chunks=2, split_points=["b", "c"], devices=["cpu"] * 3)


class CountsSizes(nn.Module):
    """Stage 1 adds to numbers read off a tensor's size; stage 2 reads their
    values from before (an augmented assignment to a number rebinds it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        n = x.size(1)
        width = x.shape[1] * 2
        m, w = n, width
        h = self.b(self.a(x))
        n += 1
        width -= 3
        return self.c(h * n * width) * m + w  # type: ignore[no-any-return]


def test_an_augmented_assignment_to_a_number_is_no_change_in_place() -> None:
    # It was refused as "'iadd' in stage 1 changes 'size' in place".
    model = CountsSizes().double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=2, split_points=["b", "c"], devices=["cpu"] * 3, tracer="fx")
    x = torch.randn(6, 4, dtype=torch.float64)
    out, expected = pipe(x), ref(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_same_grads(pipe, ref)


def _runs_as_the_module(model: nn.Module, batch: Any, tracer: str, leaves: Any = ()) -> None:
    """A 3-stage pipe of ``model`` (split at ``b`` and ``c``) computes what
    ``model`` does, given a copy of ``batch``, and its gradients."""
    model = model.double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=2, split_points=["b", "c"], devices=["cpu"] * 3, tracer=tracer,
                leaf_modules=leaves)  # fmt: skip
    out = pipe(pytree.tree_map_only(Tensor, torch.clone, batch))
    expected = ref(pytree.tree_map_only(Tensor, torch.clone, batch))
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_same_grads(pipe, ref)


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
    _runs_as_the_module(ChangesOneItem(), batch, "fx")
    refused = r"changes item \['x'\] of 'batch' in place, which stage 2"
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
    _refused(ChangesOtherField(leaf()), leaf, "pair")


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
    _runs_as_the_module(ChangesOneResult(), torch.randn(6, 4, dtype=torch.float64), "export")


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
    _refused(ChangesByIndex(tensor), Both, "both")


class Odd(NamedTuple):
    """Fields named as a tensor's attributes."""

    x: Tensor
    grad: Tensor
    shape: Tensor


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
    _refused(ChangesAnOddField(name), OddPair, "pair")


class ChangesAnOddInput(nn.Module):
    """Changes ``batch.grad`` of its namedtuple batch in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: Odd) -> Tensor:
        batch.grad.mul_(2)
        return self.b(self.a(batch.x)) + batch.grad + batch.shape  # type: ignore[no-any-return]


def test_an_input_s_field_named_as_a_tensor_attribute_gets_a_copy() -> None:
    # batch.grad was not seen as the input's: no copy, and the caller's batch changed.
    batch = Odd(*(torch.randn(7, 4, dtype=torch.float64) for _ in range(3)))
    assert _clones_per_call(ChangesAnOddInput(), batch) == 3  # of batch.grad alone, per micro-batch


class AugmentsThroughAnAttribute(nn.Module):
    """``h = x.T; h += 1`` changes ``x`` (``h`` is a view of it), which a
    later stage reads: fx read ``x.T`` as an attribute with no ``+=``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.a(x)
        h = x.T
        h += 1
        return self.c(self.b(x))  # type: ignore[no-any-return]


def test_an_augmented_assignment_to_an_attribute_changes_its_tensor() -> None:
    _runs_as_the_module(AugmentsThroughAnAttribute(), torch.randn(6, 4, dtype=torch.float64), "fx")


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
    refused = r"'mul_' in stage 1 changes item \[0\] of '\w+' in place, which stage 2 also reads"
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
    _runs_as_the_module(model, torch.randn(6, 4, dtype=torch.float64), tracer)


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


class Sorted(NamedTuple):
    """Fields named as a tensor's methods, as torch.sort's result."""

    values: Tensor
    indices: Tensor


class ChangesAMethodNamedInput(nn.Module):
    """Changes ``batch.values`` of its namedtuple batch in place; reads no other field by name."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: Sorted) -> Tensor:
        batch.values.mul_(2)
        return self.b(self.a(batch.values)) + batch.indices  # type: ignore[no-any-return]


def test_an_input_s_field_named_as_a_tensor_method_gets_a_copy() -> None:
    # batch.values was read as a tensor's method, no field of the input: no copy, so
    # the micro-batches' changes failed each other's backward.
    batch = Sorted(*(torch.randn(7, 4, dtype=torch.float64) for _ in range(2)))
    _trains_as_the_module(ChangesAMethodNamedInput(), batch, "fx")

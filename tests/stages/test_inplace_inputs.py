"""Inputs a module changes in place: each micro-batch gets a copy of the
changed tensors alone (``copy_changed_inputs`` and ``own`` of
mpstream/stages/inplace.py), the caller's batch is left as it was, and an
input object pytree cannot flatten is refused by name."""

from __future__ import annotations

import dataclasses
import types
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from tests.helpers import Ops
from tests.stages.inplace_helpers import Batch, Odd, trains_as_the_module


def _clones_per_call(model: nn.Module, batch: Any) -> int:
    """Checks that a torch.fx pipe of ``model`` trains as ``model``
    (:func:`trains_as_the_module`); the tensors it copies in one call on ``batch``."""
    pipe, _ = trains_as_the_module(model, batch, "fx")
    with Ops() as ops:
        pipe(batch)
    return ops.ops["clone"]


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
    pipe, ref = trains_as_the_module(ChangesInput(how), x, tracer)
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
    trains_as_the_module(ChangesDictInput(), batch, "fx")


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
    trains_as_the_module(ChangesNamedTupleInput(), batch, "export")


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
    trains_as_the_module(ChangesNamedTupleInput(), Batch(x, y), tracer)


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
    trains_as_the_module(ChangesAMethodNamedInput(), batch, "fx")

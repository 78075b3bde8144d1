"""Where a split's tensors are placed (:mod:`mpstream.stages.placement`)
when kinds of call read them in different stages: shared on one device,
refused across devices once an earlier split placed them, moved in place
and never made inference tensors."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import Tensor, nn

from mpstream.stages import placement
from mpstream.stages.fx import trace
from mpstream.stages.placement import place
from tests.stages.test_traced import Fallback, fx_split, pipe_of


class Reaches(nn.Module):
    """A tensor read before the split point in one kind of call, after it in
    another."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)
        self.shift = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor, late: Tensor | None = None) -> Tensor:
        if late is None:
            return self.b(self.a(x) + self.shift)  # in stage 0
        return self.b(self.a(x)) + self.shift[:2] * late  # in stage 1


def test_a_tensor_kinds_read_in_different_stages_on_one_device_is_shared() -> None:
    model = Reaches().double()
    pipe = pipe_of(model, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    late = torch.randn(4, 2, dtype=torch.float64)
    for args in [(x, late), (x,), (x, late)]:
        torch.testing.assert_close(pipe(*args), model(*args))
    assert len(fx_split(pipe).traces) == 2


@pytest.mark.parametrize("how", ["as built", "pickled"])
@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_tensor_placed_by_an_earlier_split_stays_where_it_is(tracer: str, how: str) -> None:
    x, late = torch.randn(4, 4), torch.randn(4, 2)
    pipe = pipe_of(Reaches(), chunks=2, tracer=tracer, sample=(x, late))
    pipe(x, late)  # shift read in stage 1
    if how == "pickled":  # what was placed is read from the splits, by name
        pipe = pickle.loads(pickle.dumps(pipe))
    split = pipe.__dict__["_split"]
    # As if stage 1 sat on another device (two devices need two GPUs):
    # the kind with late=None reads shift in stage 0.
    split.devices = [torch.device("cpu"), torch.device("meta")]
    for _ in range(2 if tracer == "fx" else 1):  # fx remembers a kind that failed
        with pytest.raises(
            ValueError,
            match=r"reads shift in a stage on cpu, but an earlier split \(another kind of "
            r"call\) placed shift on meta",
        ):
            pipe(x)
    assert pipe.__dict__["_root"].shift.device.type == "cpu"  # nothing moved
    split.devices = [torch.device("cpu")] * 2
    if tracer == "fx":
        assert len(split.kinds) == 1 and len(split.untraceable) == 1
    else:
        torch.testing.assert_close(pipe(x), pipe.__dict__["_root"](x))


def test_placement_never_makes_inference_tensors() -> None:
    model = Fallback()
    traced = trace(model, ["b"], nones=frozenset({"mask"}))
    # "cpu:0" is not "cpu", so placement moves stage 1's tensors as it would
    # to another GPU; under inference_mode (a validation call bringing a new
    # kind) that used to make them inference tensors, useless for training.
    with torch.inference_mode():
        devices = [torch.device("cpu"), torch.device("cpu", 0)]
        place(model, traced.partitions, traced.tensors, devices)
    assert not any(t.is_inference() for t in [*model.parameters(), *model.buffers()])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_placement_moves_tensors_in_place() -> None:
    model = Fallback()
    traced = trace(model, ["b"], nones=frozenset({"mask"}))
    fill, weight = model.fill, model.b.weight
    weight.grad = torch.ones_like(weight)  # moved along, as Module.to() moves it
    devices = [torch.device("cpu"), torch.device("cuda", 0)]
    place(model, traced.partitions, traced.tensors, devices)
    assert model.fill is fill and model.b.weight is weight  # held elsewhere too
    assert fill.is_cuda and weight.is_cuda and weight.grad is not None and weight.grad.is_cuda


def test_a_tensor_data_cannot_carry_is_replaced_unless_a_parameter() -> None:
    model = Fallback()
    # CPU to meta: .data cannot carry it (as for some layouts across devices).
    placement._move(model, "fill", torch.device("meta"))
    assert model.fill.device.type == "meta"
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        placement._move(model, "b.weight", torch.device("meta"))  # a parameter stays one object

"""Where a split's tensors are placed (:mod:`mpstream.stages.placement`)
when kinds of call read them in different stages: shared on one device,
refused across devices once an earlier split placed them, moved in place
and never made inference tensors; the stages pointed at a module's
tensors again after they change (a parameter made a buffer; one
parametrized after the trace is refused)."""

from __future__ import annotations

import copy
import pickle
import re
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated
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


class Direct(nn.Module):
    """Blocks whose traced code reads their tensors itself (no layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
        self.scale = nn.Parameter(torch.rand(3, dtype=torch.float64) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(nn.functional.linear(x, self.w) * self.scale)


class Directs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Direct(), Direct()])

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks[1](self.blocks[0](x))


class Positive(nn.Module):
    def forward(self, scale: Tensor) -> Tensor:
        return scale.abs() + 0.25


def direct_pipe(model: nn.Module, tracer: str = "fx", graphs: bool = False) -> Any:
    sample = (torch.randn(2, 3, dtype=torch.float64),) if tracer == "export" else None
    return Pipe(
        model,
        chunks=2,
        devices=["cpu", "cpu"],
        split_points=["blocks.1"],
        tracer=tracer,
        sample=sample,
        graphs=Emulated() if graphs else False,
    )


def assert_as_plain(pipe: nn.Module, plain: nn.Module) -> None:
    """pipe(x) with a backward, and a train_step, equal the plain model's."""
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    for step in (False, True):
        pipe.zero_grad()
        plain.zero_grad()
        expected = torch.cat([plain(part) for part in x.chunk(2)])
        loss = nn.functional.mse_loss(expected, y)
        loss.backward()  # type: ignore[no-untyped-call]
        if step:
            torch.testing.assert_close(pipe.train_step(x, y, nn.functional.mse_loss), loss.detach())
        else:
            out = pipe(x)
            torch.testing.assert_close(out, expected)
            nn.functional.mse_loss(out, y).backward()  # type: ignore[no-untyped-call]
        got = {n: p.grad for n, p in pipe.named_parameters()}
        for name, p in plain.named_parameters():
            torch.testing.assert_close(got[name], p.grad, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("graphs", [False, True])
def test_a_tensor_a_stage_reads_parametrized_after_the_trace_is_refused(graphs: bool) -> None:
    model = Directs()
    pipe = direct_pipe(model, graphs=graphs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a graphed stage's eager first calls
        pipe(torch.randn(4, 3, dtype=torch.float64))
        parametrize.register_parametrization(model.blocks[1], "scale", Positive())
        x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
        message = "'blocks.1.scale' was parametrized (torch.nn.utils.parametrize) after"
        for _ in range(2):  # refused at every call, not once
            with pytest.raises(TypeError, match=re.escape(message)):
                pipe(x)
            with pytest.raises(TypeError, match=re.escape(message)):
                pipe.train_step(x, y, nn.functional.mse_loss)
        # Parametrized before the pipe is built, the trace computes it.
        model = Directs()
        parametrize.register_parametrization(model.blocks[1], "scale", Positive())
        plain = copy.deepcopy(model)
        assert_as_plain(direct_pipe(model, graphs=graphs), plain)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_parameter_replaced_by_a_buffer_of_its_name_is_what_stages_read(tracer: str) -> None:
    model = Directs()
    plain = copy.deepcopy(model)
    pipe = direct_pipe(model, tracer)
    assert_as_plain(pipe, plain)
    for m in (pipe, plain):
        block = m.get_submodule("blocks.1")
        del block.scale
        block.register_buffer("scale", torch.full((3,), 0.75, dtype=torch.float64))
    assert_as_plain(pipe, plain)


def test_a_conversion_refused_for_a_parametrization_after_the_trace_converts_nothing() -> None:
    model = Directs()
    pipe = direct_pipe(model)
    x = torch.randn(4, 3, dtype=torch.float64)
    pipe(x)
    parametrize.register_parametrization(model.blocks[1], "scale", Positive())
    with pytest.raises(TypeError, match=re.escape("'blocks.1.scale' was parametrized")):
        pipe.to(torch.float32)
    # Refused before converting: the pipe is as it was (no tensor made float32).
    assert {p.dtype for p in pipe.parameters()} == {torch.float64}
    parametrize.remove_parametrizations(model.blocks[1], "scale")
    torch.testing.assert_close(pipe(x), model(x))


class _SpectralNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.utils.spectral_norm(nn.Linear(4, 4))
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_a_tensor_a_stage_reads_removed_after_the_split_is_named() -> None:
    # remove_spectral_norm deletes weight_orig, which the exported stage
    # reads: the next call failed in a lookup with "'Linear' object has no
    # attribute 'weight_orig'".
    pipe = Pipe(_SpectralNormed().double(), chunks=2, split_points=["b"], devices=["cpu"] * 2,
                tracer="export")  # fmt: skip
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe.eval()
    pipe(x)
    nn.utils.remove_spectral_norm(pipe.a)
    for _ in range(2):  # and again: nothing was half done
        with pytest.raises(TypeError, match=r"reads 'a\.weight_orig', which the module no longer"):
            pipe(x)

"""A module split by torch.fx is traced again for each kind of call: None
arguments and training flags are followed as the module's code follows
them; outputs and gradients equal the unsplit module's for every kind, in
any order; a trace that fails leaves the pipe as it was."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import mpstream
from mpstream import NoChunk, Pipe
from mpstream.stages import placement
from mpstream.stages.balance import profile_units
from mpstream.stages.fx import trace
from mpstream.stages.placement import place
from mpstream.stages.traced import FxSplit


class Masked(nn.Module):
    """An optional argument tested with ``is not None``, and a skipped branch
    with its own layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.proj = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(
        self, x: Tensor, scale: Tensor | None = None, extra: Tensor | None = None
    ) -> Tensor:
        h = self.a(x)
        if scale is not None:
            h = h * self.proj(scale)
        return self.b(h)


class Chained(nn.Module):
    """One argument read only where another is None."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: Tensor, a: Tensor | None = None, b: Tensor | None = None) -> Tensor:
        h = self.a(x)
        if a is not None:
            h = h + a
        elif b is not None:
            h = h * b
        return self.b(h)


class ModeAware(nn.Module):
    """Code that reads its own training flag (fixed by a trace)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if self.training:
            h = h * 3.0
        return self.b(F.dropout(h, 0.5, self.training))


def pipe_of(model: nn.Module, **kw: Any) -> Pipe:
    return Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, **kw)


def fx_split(pipe: Pipe) -> FxSplit:
    split = pipe.__dict__["_split"]
    assert isinstance(split, FxSplit)
    return split


def same_grads(pipe: nn.Module, model: nn.Module) -> None:
    """Gradients equal, a parameter no kind of call reached has none in both."""
    for (name, p), (_, q) in zip(pipe.named_parameters(), model.named_parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("split_size", [2, 3])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_an_optional_argument_given_or_not(split_size: int, schedule: str) -> None:
    model = Masked().double()
    pipe = pipe_of(model, split_size=split_size, schedule=schedule)
    x = torch.randn(5, 4, dtype=torch.float64)
    s = torch.randn(5, 4, dtype=torch.float64)
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((x,), {}), ((x, s), {}), ((x,), {"scale": None}), ((x,), {"scale": s}), ((x,), {})
    ]  # fmt: skip
    for args, kwargs in calls:
        pipe.zero_grad()
        model.zero_grad()
        out = pipe(*args, **kwargs)
        expected = model(*args, **kwargs)
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        same_grads(pipe, model)
    split = fx_split(pipe)
    assert len(split.traces) == 2  # each kind traced once, then reused
    report = str(pipe.split_report())
    assert "traced for: training: every argument given" in report
    assert "traced for: training: extra=None, scale=None" in report
    # Every split takes every argument (those traced as None unused), so a
    # None the code does not test shares the value trace's split.
    assert split.traces[1].bind.names == ["x", "scale", "extra"]
    assert pipe._inputs((x, s), {}) == (x, s, None) and pipe.graph is split.traces[0].graph


def test_train_step_on_each_kind() -> None:
    model = Masked().double()
    pipe = pipe_of(model, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    s = torch.randn(4, 4, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    for inputs in [x, (x, s), (x,)]:
        pipe.zero_grad()
        model.zero_grad()
        loss = pipe.train_step(inputs, y, nn.MSELoss())
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        expected = F.mse_loss(model(*args), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        same_grads(pipe, model)


def test_an_argument_read_only_where_another_is_none() -> None:
    model = Chained().double()
    pipe = pipe_of(model, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    a, b = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    for kwargs in [{"a": a, "b": b}, {"b": b}, {}, {"a": a}, {"a": None, "b": None}]:
        torch.testing.assert_close(pipe(x, **kwargs), model(x, **kwargs))
    described = [t.split(": ", 1)[1] for t in pipe.split_report().traces]
    assert described == ["every argument given", "a=None", "a=None, b=None"]


def test_nochunk_and_none_together() -> None:
    model = Masked().double()
    pipe = pipe_of(model, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    s = torch.randn(4, dtype=torch.float64)
    torch.testing.assert_close(pipe(x, NoChunk(s)), model(x, s))
    torch.testing.assert_close(pipe(x, None), model(x))


def test_code_reading_the_training_flag_follows_the_pipes_mode() -> None:
    model = ModeAware().double()
    pipe = pipe_of(model, chunks=2)
    x = torch.randn(6, 4, dtype=torch.float64)
    pipe.eval()
    model.eval()
    torch.testing.assert_close(pipe(x), model(x))  # no dropout, no factor 3
    pipe.train()
    model.train()
    torch.manual_seed(0)
    out = pipe(x)
    # Dropout zeroes about half of the hidden values: not the eval output.
    assert not torch.allclose(out, model.eval()(x))
    assert "traced for: eval: every argument given" in str(pipe.split_report())
    pipe.eval()
    torch.testing.assert_close(pipe(x), model(x))
    assert len(fx_split(pipe).traces) == 2


def test_a_mode_change_the_code_ignores_reuses_the_split_and_its_runtime() -> None:
    model = Masked()
    pipe = pipe_of(model, chunks=2)
    x, s = torch.randn(4, 4), torch.randn(4, 4)
    pipe(x, s)
    runtime = pipe.__dict__["_runtime"]
    graph = pipe.graph
    pipe.eval()
    pipe(x, s)
    split = fx_split(pipe)
    assert len(split.traces) == 1 and len(split.kinds) == 3  # (), (extra) in each mode
    assert pipe.graph is graph and pipe.__dict__["_runtime"] is runtime


class LenOfMask(nn.Module):
    """Traces with a mask, not without one (``len`` of a value fx cannot follow)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        h = self.a(x)
        h = h * (mask if mask is not None else torch.ones(len(h), 1))
        return self.b(h)


def test_a_kind_that_cannot_be_traced_fails_clearly_and_leaves_the_pipe_as_it_was() -> None:
    model = LenOfMask().double()
    pipe = pipe_of(model, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    m = torch.randn(4, 1, dtype=torch.float64)
    torch.testing.assert_close(pipe(x, m), model(x, m))
    for _ in range(2):
        with pytest.raises(TypeError) as raised:
            pipe(x)
        message = str(raised.value)
        assert "could not trace LenOfMask in its own forward with mask=None" in message
        assert "(traced for this kind of call: training: mask=None)" in message
    assert len(fx_split(pipe).kinds) == 1
    torch.testing.assert_close(pipe(x, m), model(x, m))


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


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_keeps_every_kind(how: str) -> None:
    model = Masked().double()
    pipe = pipe_of(model, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    s = torch.randn(4, 4, dtype=torch.float64)
    pipe(x)
    pipe(x, s)
    if how == "deepcopy":
        copied = copy.deepcopy(pipe)
    else:
        buffer = io.BytesIO()
        torch.save(pipe, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    assert len(fx_split(copied).traces) == 2
    with torch.no_grad():
        for p in copied.parameters():
            p.add_(1.0)
        for p in model.parameters():
            p.add_(1.0)
    for args in [(x,), (x, s), (x,)]:
        torch.testing.assert_close(copied(*args), model(*args))
    assert len(fx_split(copied).traces) == 2
    assert pickle.loads(pickle.dumps(pipe.split_report())) == pipe.split_report()


def test_balance_by_time_profiles_the_samples_kind() -> None:
    model = Masked()
    names, profiles = profile_units(model, (torch.randn(4, 4), None))
    assert names == ["b"] and len(profiles) == 2
    pipe = Pipe(model, balance="time", devices=["cpu"] * 2, sample=(torch.randn(4, 4), None))
    x = torch.randn(4, 4)
    torch.testing.assert_close(pipe(x), model(x))
    # A dict is keyword arguments, as for torch.export.
    names, _ = profile_units(model, {"x": torch.randn(4, 4), "scale": torch.randn(4, 4)})
    assert names == ["proj", "b"]
    keyed = Pipe(model, balance="time", devices=["cpu"] * 2, sample={"x": torch.randn(4, 4)})
    assert fx_split(keyed).traces[0].described == "training: extra=None, scale=None"


class Fallback(nn.Module):
    """A layer called only when the mask is None; a frozen-able BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.fallback = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)
        self.register_buffer("fill", torch.ones(2))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        h = self.norm(self.a(x))
        h = self.fallback(h) if mask is None else h * mask
        return self.b(h) + (self.fill if mask is None else 0.0)


def test_flags_set_on_submodules_survive_a_switch_of_kind() -> None:
    model = Fallback().double()
    pipe = pipe_of(model, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    m = torch.randn(4, 4, dtype=torch.float64)
    pipe.train()
    pipe.norm.eval()  # frozen statistics while training the rest
    model.train()
    model.norm.eval()
    for args in [(x, m), (x,), (x, m)]:
        torch.testing.assert_close(pipe(*args), model(*args))
        assert not pipe.norm.training
    torch.testing.assert_close(pipe.norm.running_mean, model.norm.running_mean)


def test_a_steps_snapshot_takes_the_stages_of_the_kind_it_runs() -> None:
    # The failure snapshot saves each stage's gradients at that stage's
    # first backward: after a switch of kind, the current split's stages.
    model = Fallback().double()
    pipe = pipe_of(model, chunks=2)
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    m = torch.randn(4, 4, dtype=torch.float64)
    for args in [(x, m), (x,), (x, m)]:
        pipe.train_step(args, y, nn.MSELoss())
        current = [list(part.parameters()) for part in pipe.partitions]
        assert [[id(p) for p in ps] for ps in pipe._stage_params()] == [
            [id(p) for p in ps] for ps in current
        ]


def test_a_module_passed_in_eval_mode_runs_in_eval_mode() -> None:
    model = ModeAware().double().eval()
    pipe = pipe_of(model, chunks=2)
    x = torch.randn(6, 4, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), model(x))
    assert [t.described for t in fx_split(pipe).traces] == ["eval: every argument given"]


def test_leaf_flags_do_not_make_a_kind() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    pipe = Pipe(model, split_points=["2"], devices=["cpu"] * 2, tracer="fx", chunks=2)
    split = fx_split(pipe)
    assert split.watched == [model]  # the Sequential's code; its layers are leaves
    pipe(torch.randn(4, 4))
    model[1].eval()
    pipe(torch.randn(4, 4))
    assert len(split.kinds) == 1


def test_a_split_point_only_some_kinds_reach() -> None:
    model = Fallback().double()
    model.norm.eval()  # whole-batch statistics would differ from micro-batches'
    x = torch.randn(4, 4, dtype=torch.float64)
    m = torch.randn(4, 4, dtype=torch.float64)
    # 'fallback' is reached only by calls without a mask: build for those.
    with pytest.raises(ValueError, match=r"split point 'fallback'(.|\n)*training: every argument"):
        Pipe(copy.deepcopy(model), split_points=["fallback"], devices=["cpu"] * 2)
    pipe = Pipe(
        copy.deepcopy(model), split_points=["fallback"], devices=["cpu"] * 2, chunks=2,
        sample=(x, None),
    )  # fmt: skip
    torch.testing.assert_close(pipe(x), model(x))
    with pytest.raises(ValueError, match=r"(.|\n)*traced for this kind of call: training: every"):
        pipe(x, m)
    torch.testing.assert_close(pipe(x), model(x))  # the pipe works on


class EvalOnlyLen(nn.Module):
    """The value trace fails in eval mode; the trace without a mask does not."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        h = self.a(x)
        if mask is not None and not self.training:
            h = h * len(mask)
        return self.b(h)


def test_a_call_is_traced_for_its_own_kind() -> None:
    model = EvalOnlyLen().double()
    pipe = pipe_of(model, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe.eval()
    model.eval()
    torch.testing.assert_close(pipe(x), model(x))


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


def test_profile_spans_a_switch_of_kind() -> None:
    pipe = pipe_of(Masked(), chunks=4)
    x, s = torch.randn(8, 4), torch.randn(8, 4)
    pipe(x, s)
    scheduler = pipe.scheduler
    with mpstream.profile(pipe) as prof:
        pipe(x)
        pipe(x, s)
    assert pipe.scheduler is scheduler  # one for every kind
    assert len(prof.spans) == 2 * 8 and not scheduler.timing


def test_a_pipe_pickled_before_kinds_loads_with_its_trace_as_the_first() -> None:
    model = Masked().double()
    pipe = pipe_of(model, chunks=2, leaf_modules=["proj"])
    state = copy.deepcopy(pipe.__getstate__())
    # What such a pickle held: the one trace's binder, no split per kind.
    state["_bind"] = state["_split"].current.traced.bind
    state["_split"] = None
    old = Pipe.__new__(Pipe)
    old.__setstate__(state)
    split = fx_split(old)
    assert split.leaf_modules == ["a", "b", "proj"]  # what the trace called whole
    x = torch.randn(4, 4, dtype=torch.float64)
    s = torch.randn(4, 4, dtype=torch.float64)
    for args in [(x, s), (x,)]:
        torch.testing.assert_close(old(*args), model(*args))
    assert len(split.traces) == 2


def test_a_tensor_data_cannot_carry_is_replaced_unless_a_parameter() -> None:
    model = Fallback()
    # CPU to meta: .data cannot carry it (as for some layouts across devices).
    placement._move(model, "fill", torch.device("meta"))
    assert model.fill.device.type == "meta"
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        placement._move(model, "b.weight", torch.device("meta"))  # a parameter stays one object


class OnlyTested(nn.Module):
    """An argument only tested, never computed with."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: Tensor, flag: Tensor | None = None) -> Tensor:
        h = self.a(x)
        if flag is not None:
            h = h * 2
        return self.b(h)


def test_an_argument_only_tested_for_none_is_followed() -> None:
    model = OnlyTested().double()
    pipe = pipe_of(model, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    for args in [(x,), (x, x), (x,)]:
        torch.testing.assert_close(pipe(*args), model(*args))


class Scale(nn.Module):
    """Scales by 3 in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x) * (3.0 if self.training else 1.0)


class Blocks(nn.Module):
    """Blocks in a ModuleList, which fx calls a leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Scale(), Scale()])
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_flags_of_blocks_in_a_module_list_make_kinds() -> None:
    model = Blocks().double()
    pipe = Pipe(copy.deepcopy(model), split_points=["blocks.1"], devices=["cpu"] * 2, chunks=2)
    assert {type(m).__name__ for m in fx_split(pipe).watched} == {"Blocks", "ModuleList", "Scale"}
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe.eval()
    model.eval()
    pipe.blocks[1].train()
    model.blocks[1].train()
    torch.testing.assert_close(pipe(x), model(x))
    pipe.blocks[1].eval()
    model.blocks[1].eval()
    torch.testing.assert_close(pipe(x), model(x))
    assert len(fx_split(pipe).traces) == 3  # training (built), one block in it, eval


class Constant(nn.Module):
    """A tensor fx computes while tracing (it becomes a stage's constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        h = self.a(x) * torch.full((4,), 2.0, dtype=torch.float64)  # computed by the trace
        return self.b(h if mask is None else h * mask)


def test_a_kind_first_met_under_inference_mode_trains_later() -> None:
    model = Constant().double()
    pipe = pipe_of(model, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    with torch.inference_mode():
        pipe(x)  # a validation call brings the mask=None kind
    loss = pipe.train_step(x, torch.zeros(4, 2, dtype=torch.float64), nn.MSELoss())
    expected = F.mse_loss(model(x), torch.zeros(4, 2, dtype=torch.float64))
    torch.testing.assert_close(loss, expected.detach())


def test_a_pipe_starts_in_its_modules_mode() -> None:
    model = ModeAware().double().eval()
    pipe = pipe_of(model)
    assert not pipe.training
    x = torch.randn(4, 4, dtype=torch.float64)
    exported = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, tracer="export",
        sample=(x,), chunks=2,
    )  # fmt: skip
    assert not exported.training
    torch.testing.assert_close(exported(x), model(x))
    assert exported.split_report().exports[0].startswith("eval")


class Required(nn.Module):
    """A required argument a call may give as None, another after it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: Tensor, mask: Tensor | None, y: Tensor) -> Tensor:
        h = self.a(x)
        if mask is not None:
            h = h * mask
        return self.b(h + y)


def test_a_required_argument_given_as_none() -> None:
    model = Required().double()
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe = pipe_of(model, chunks=2)
    for args in [(x, x, x), (x, None, x)]:
        torch.testing.assert_close(pipe(*args), model(*args))
    sampled = pipe_of(model, chunks=2, sample=(x, None, x))
    torch.testing.assert_close(sampled(x, None, x), model(x, None, x))


def test_kinds_with_equal_constants_share_a_split() -> None:
    model = Constant().double()
    pipe = pipe_of(model, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    for args in [(x, x), (x,)]:
        torch.testing.assert_close(pipe(*args), model(*args))
    pipe.eval()
    model.eval()
    torch.testing.assert_close(pipe(x, x), model(x, x))
    split = fx_split(pipe)
    assert len(split.kinds) == 3 and len(split.traces) == 2  # eval shares training's code
    root = pipe.__dict__["_root"]
    held = [n for n in vars(root) if n.startswith("_tensor_constant")]
    assert len(held) == 2  # one per split kept; the shared trace's went


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_the_modules_own_flags_decide_its_mode(tracer: str) -> None:
    model = ModeAware().double().eval()
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, tracer=tracer,
        sample=(x,), chunks=2,
    )  # fmt: skip
    torch.testing.assert_close(pipe(x), model(x))
    root = pipe.__dict__["_root"]
    root.training = True  # set on the module, not through the pipe
    model.training = True
    torch.manual_seed(0)
    out = pipe(x)
    # Dropout draws differ from the model's; the training branch (x3) shows.
    assert out.abs().mean() > 1.5 * model.eval()(x).abs().mean()
    pipe.eval()
    torch.testing.assert_close(pipe(x), model(x))

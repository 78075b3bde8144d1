"""A module split by torch.fx is traced again for each kind of call: None
arguments are followed as the module's code follows them; outputs and
gradients equal the unsplit module's for every kind, in any order; a trace
that fails leaves the pipe as it was. (Training flags: test_traced_modes.py;
None items and keys looked up: test_traced_items.py, test_traced_lookups.py;
where tensors are placed: test_placement.py; copies and pickles:
test_traced_copies.py.)"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import mpstream
from mpstream import NoChunk, Pipe
from mpstream.stages.balance import profile_units
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

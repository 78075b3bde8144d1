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
    assert "traced for: training: scale=None" in report
    # The None kind's stages take no input for scale; extra, never used, is not fixed.
    assert split.traces[1].bind.names == ["x", "extra"]


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
    assert len(split.traces) == 1 and len(split.kinds) == 2
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
        with pytest.raises(
            TypeError, match="could not trace LenOfMask in its own forward with mask=None"
        ):
            pipe(x)
    assert len(fx_split(pipe).kinds) == 1
    torch.testing.assert_close(pipe(x, m), model(x, m))


def test_a_tensor_placed_by_an_earlier_trace_stays_where_it_is() -> None:
    model = Masked()
    pipe = pipe_of(model, chunks=2)
    split = fx_split(pipe)
    # As if the first trace had put b.weight on another device than the
    # stage of the None kind that reads it (two devices need two GPUs).
    split.placed["b.weight"] = torch.device("cuda", 1)
    with pytest.raises(
        ValueError,
        match=r"reads b.weight in a stage on cpu, but an earlier trace placed b.weight on cuda:1",
    ):
        pipe(torch.randn(4, 4))
    assert len(split.kinds) == 1


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

"""One kind of call exported on fake tensors (mpstream.stages.fake_export):
arguments a ``**kwargs`` parameter gathers keep a symbolic batch dimension
on every torch (torch 2.11's export could not be given one for them), and
the module's forward is left as it was, the export failed or not; an input
of a dataclass registered with pytree is exported and trains as with
torch.fx. The pipeline runs such a graph on micro-batches of other sizes in
tests/stages/test_export_calls.py."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from mpstream import Pipe
from mpstream.stages.fake_export import exported_graph, input_pattern
from tests.helpers import assert_same_grads

CPU = torch.device("cpu")


class _Extras(nn.Module):
    """Reads extra keyword arguments from ``**kwargs``, as a Hugging Face
    forward does, beside a named optional one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, input_ids: Tensor, mask: Tensor | None = None, **extra: Tensor) -> Tensor:
        h: Tensor = self.a(input_ids) * extra["scale"]
        return h if mask is None else h * mask


def _placeholders(gm: torch.fx.GraphModule) -> list[Any]:
    return [input_pattern(n) for n in gm.graph.nodes if n.op == "placeholder"]


def _keywords(in_spec: pytree.TreeSpec) -> list[str]:
    """The call's keywords, in the order the graph takes its inputs."""
    _, kwargs = pytree.tree_unflatten([None] * in_spec.num_leaves, in_spec)
    return list(kwargs)


def test_arguments_in_kwargs_keep_a_symbolic_batch_dimension() -> None:
    torch.manual_seed(0)
    model = _Extras()
    x, s = torch.randn(6, 4), torch.randn(6, 1)
    gm, in_spec, _ = exported_graph(model, {"input_ids": x, "scale": s}, CPU)
    assert [p[2] for p in _placeholders(gm)] == [(None, 4), (None, 1)]
    assert _keywords(in_spec) == ["input_ids", "scale"]


def test_a_named_argument_beside_kwargs_is_exported_as_before() -> None:
    model = _Extras()
    x, s, m = torch.randn(6, 4), torch.randn(6, 1), torch.randn(6, 4)
    gm, in_spec, _ = exported_graph(model, {"input_ids": x, "mask": m, "scale": s}, CPU)
    assert [p[2] for p in _placeholders(gm)] == [(None, 4), (None, 4), (None, 1)]
    assert _keywords(in_spec) == ["input_ids", "mask", "scale"]


def test_the_modules_forward_is_left_as_it_was() -> None:
    model = _Extras()
    x, s = torch.randn(6, 4), torch.randn(6, 1)
    exported_graph(model, {"input_ids": x, "scale": s}, CPU)
    assert "forward" not in vars(model)
    with pytest.raises(Exception, match="scale"):  # the forward's own KeyError
        exported_graph(model, {"input_ids": x, "other": s}, CPU)
    assert "forward" not in vars(model)

    # An instance's own forward (as a hook library sets one) comes back.
    def hooked(*args: Any, **kwargs: Any) -> Tensor:
        return _Extras.forward(model, *args, **kwargs)

    model.forward = hooked  # type: ignore[method-assign]
    gm, _, _ = exported_graph(model, {"input_ids": x, "scale": s}, CPU)
    assert vars(model)["forward"] is hooked
    assert [p[2] for p in _placeholders(gm)] == [(None, 4), (None, 1)]


def test_a_torch_without_check_guards_exports_the_same_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch before 2.9 has no ``check_guards`` argument (the floor is 2.7)."""
    model = _Extras()
    x, s = torch.randn(6, 4), torch.randn(6, 1)
    expected, _, _ = exported_graph(model, {"input_ids": x, "scale": s}, CPU)
    plain = torch.export.ExportedProgram.module

    def module(self: torch.export.ExportedProgram) -> torch.fx.GraphModule:
        return plain(self, check_guards=False)  # type: ignore[call-arg]

    monkeypatch.setattr(torch.export.ExportedProgram, "module", module)
    gm, _, _ = exported_graph(model, {"input_ids": x, "scale": s}, CPU)
    assert gm.code == expected.code


@dataclasses.dataclass
class _Scales:
    scale: Tensor
    shift: Tensor | None = None


@dataclasses.dataclass
class _Batch:
    x: Tensor
    scales: _Scales


pytree.register_dataclass(_Scales)
pytree.register_dataclass(_Batch)


class _Reads(nn.Module):
    """Reads its input from a registered dataclass holding another."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, batch: _Batch) -> Tensor:
        h = torch.tanh(self.a(batch.x)) * batch.scales.scale
        if batch.scales.shift is not None:
            h = h + batch.scales.shift
        out: Tensor = self.b(h)
        return out


@pytest.mark.parametrize("rows", [6, 7])
@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_registered_dataclass_input_trains_as_the_plain_model(tracer: str, rows: int) -> None:
    """torch.export wants a registered class's dynamic shapes as a list.
    (torch.fx traces a field that is None as a tensor: export alone gets one.)"""
    torch.manual_seed(0)
    model = _Reads().double()
    shifts = [torch.randn(rows, 4, dtype=torch.float64), None]
    for shift in shifts:
        x, s = torch.randn(rows, 4, dtype=torch.float64), torch.randn(rows, 4, dtype=torch.float64)
        y = torch.randn(rows, 2, dtype=torch.float64)
        batch = _Batch(x, _Scales(s, shift))
        ref = copy.deepcopy(model)
        pipe = Pipe(
            copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=3,
            tracer=tracer, sample={"batch": batch},
        )  # fmt: skip
        torch.testing.assert_close(pipe(batch), ref(batch))  # 2+2+2 or 3+3+1 rows
        loss = pipe.train_step({"batch": batch}, y, nn.functional.mse_loss)
        expected = nn.functional.mse_loss(ref(batch), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        assert_same_grads(pipe, ref)

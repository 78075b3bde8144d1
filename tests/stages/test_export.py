"""Modules split by torch.export: where torch.fx fails or when asked, the
stages equal the unsplit module (outputs, loss, every gradient) on every
schedule and checkpoint mode; the split report says which tracer and why;
every failure names the module, the tracer and what to do."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils import _pytree as pytree

from mpstream import Pipe
from mpstream.stages import export
from mpstream.stages.export import split_candidates
from mpstream.stages.points import SplitPointError
from tests.helpers import assert_same_grads, mlp
from tests.models import Fan


class Shaped(nn.Module):
    """What torch.fx cannot trace: a branch on a shape, keyword arguments,
    an optional input and a dict output with the module's own loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(
        self, x: Tensor, target: Tensor | None = None, *, scale: float = 1.0
    ) -> dict[str, Tensor]:
        h = torch.tanh(self.embed(x))
        if h.shape[-1] == 8:  # a branch torch.fx cannot take
            h = h * scale
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        out = {"logits": self.head(h)}
        if target is not None:
            out["loss"] = F.mse_loss(out["logits"], target)
        return out


class Gate(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x if x.mean() > 0 else -x  # a branch on a value: neither tracer


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.gate, self.out = nn.Linear(4, 4), Gate(), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.gate(self.inp(x)))


class FixedBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x).reshape(6, 4))  # the batch size written into the code


def data(n: int = 7) -> tuple[Tensor, Tensor]:
    return torch.randn(n, 4, dtype=torch.float64), torch.randn(n, 2, dtype=torch.float64)


def test_where_torch_fx_fails_torch_export_splits_and_trains_equal() -> None:
    torch.manual_seed(0)
    model = Shaped().double()
    ref = copy.deepcopy(model)
    x, y = data()
    pipe = Pipe(
        model, chunks=3, split_points=["blocks.1", "head"], devices=["cpu"] * 3,
        sample={"x": x, "target": y},
    )  # fmt: skip
    report = pipe.split_report()
    assert report.tracer == "torch.export"
    assert "torch.fx could not trace it" in report.reason
    assert "split by torch.export" in str(report)
    assert list(pipe.state_dict()) == list(ref.state_dict())

    out = pipe(x, target=y, scale=0.5)
    expected = ref(x, target=y, scale=0.5)
    assert set(out) == {"logits", "loss"}
    torch.testing.assert_close(out["logits"], expected["logits"])
    # 7 examples in micro-batches of 3, 3, 1: each loss weighted by its share.
    torch.testing.assert_close(out["loss"], expected["loss"])
    out["loss"].backward()
    expected["loss"].backward()
    assert_same_grads(pipe, ref)
    assert len(report.exports) == 1 and len(pipe.split_report().exports) == 2  # scale=0.5

    for schedule in ["gpipe", "1f1b", "zb_h1"]:
        for mode in ["never", "except_last", "always"]:
            pipe.zero_grad()
            ref.zero_grad()
            pipe.schedule, pipe.checkpoint = schedule, mode
            loss = pipe.train_step({"x": x, "target": y})  # the module's own loss
            expected_loss = ref(x, target=y)["loss"]
            expected_loss.backward()
            torch.testing.assert_close(loss, expected_loss.detach())
            assert_same_grads(pipe, ref)


def test_tracer_export_on_a_traceable_module_equals_it_everywhere() -> None:
    torch.manual_seed(0)
    model = Fan().double()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 4, dtype=torch.float64)
    target = torch.randn(6, 3, dtype=torch.float64)
    pipe = Pipe(
        model, split_size=4, split_points=["a", "b", "c"], devices=["cpu"] * 4,
        tracer="export", sample=(x,),
    )  # fmt: skip
    assert pipe.split_report().reason == "tracer='export' was asked for"
    assert [0 in r for r in pipe.graph.reads()] == [False, True, True, True]
    out = pipe(x)
    torch.testing.assert_close(out, ref(x))
    for schedule in ["gpipe", "1f1b", "zb_h1"]:
        for mode in ["never", "always"]:
            pipe.zero_grad()
            ref.zero_grad()
            pipe.schedule, pipe.checkpoint = schedule, mode
            loss = pipe.train_step(x, target, nn.MSELoss())
            expected = nn.MSELoss()(ref(x), target)
            expected.backward()
            torch.testing.assert_close(loss, expected.detach())
            assert_same_grads(pipe, ref)


def test_the_export_leaves_the_parameters_in_place() -> None:
    model = Fan().double()
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    pipe = Pipe(model, split_points=["b"], devices=["cpu"] * 2, tracer="export",
                sample=(torch.randn(2, 4, dtype=torch.float64),))  # fmt: skip
    for name, p in pipe.named_parameters():
        assert p is before[name][0] and torch.equal(p, before[name][1])


def test_the_split_report_names_the_other_tracers() -> None:
    seq = Pipe(mlp([4, 4, 4]), balance=[2, 2], devices=["cpu"] * 2)
    assert seq.split_report().tracer == "nn.Sequential"
    fx = Pipe(Fan(), split_points=["b"], devices=["cpu"] * 2)
    assert fx.split_report().tracer == "torch.fx"
    assert fx.split_report().split_points == ("b",)


def test_neither_tracer_the_error_names_both_reasons_and_what_to_do() -> None:
    x = torch.randn(4, 4)
    with pytest.raises(TypeError) as info:
        Pipe(Gated(), split_points=["out"], devices=["cpu"] * 2, sample=(x,))
    message = str(info.value)
    assert "torch.export could not export Gated inside submodule 'gate'" in message
    assert "torch.fx could not trace it either" in message
    assert "data-dependent" in message and "leaf_modules" in message
    assert len(message.splitlines()) == 3  # first lines only, no traceback
    # torch.fx with the submodule as a leaf splits it.
    pipe = Pipe(Gated(), split_points=["out"], devices=["cpu"] * 2, tracer="fx",
                leaf_modules=["gate"])  # fmt: skip
    assert pipe(x).shape == (4, 2)


def test_without_a_sample_torch_export_splits_at_the_first_call() -> None:
    # The first call is the example (see test_export_first_call.py); only
    # what profiles before any call still asks for a sample.
    pipe = Pipe(Shaped(), split_points=["head"], devices=["cpu"] * 2)
    assert "torch.fx could not trace it" in pipe.split_report().reason
    with pytest.raises(RuntimeError, match=r"not split yet.*\(or pass sample="):
        pipe.graph.reads()
    assert pipe(torch.randn(3, 4))["logits"].shape == (3, 2)
    assert pipe.graph.reads() == ((-1,), (0,))
    with pytest.raises(ValueError, match="balance='time' needs devices= .* and sample="):
        Pipe(Shaped(), balance="time", devices=["cpu"] * 2)


def test_tracer_fx_does_not_fall_back_and_a_bad_tracer_is_named() -> None:
    with pytest.raises(TypeError, match="torch.fx could not trace Shaped"):
        Pipe(Shaped(), split_points=["head"], devices=["cpu"] * 2, tracer="fx")
    with pytest.raises(ValueError, match="tracer must be one of 'auto', 'fx', 'export'"):
        Pipe(Fan(), split_points=["b"], devices=["cpu"] * 2, tracer="dynamo")


def test_a_batch_size_written_into_the_code_is_refused() -> None:
    with pytest.raises(TypeError, match="fixed the batch dimension of input"):
        Pipe(FixedBatch(), split_points=["b"], devices=["cpu"] * 2, tracer="export",
             sample=(torch.randn(6, 4),))  # fmt: skip


def test_bad_split_points_are_named() -> None:
    with pytest.raises(ValueError, match="'blocks.2'"):
        Pipe(Shaped(), split_points=["blocks.7"], devices=["cpu"] * 2,
             sample={"x": torch.randn(2, 4)})  # fmt: skip
    sample = {"x": torch.randn(2, 4)}
    with pytest.raises(ValueError, match="out of call order: 'blocks.0' runs before 'blocks.1'"):
        Pipe(Shaped(), split_points=["blocks.1", "blocks.0"], devices=["cpu"] * 3, sample=sample)
    with pytest.raises(ValueError, match="begin at the same operation: stage 1 would be empty"):
        Pipe(Shaped(), split_points=["blocks", "blocks.0"], devices=["cpu"] * 3, sample=sample)
    with pytest.raises(ValueError, match="stage 0 would be empty"):
        Pipe(Shaped(), split_points=["embed"], devices=["cpu"] * 2, sample=sample)
    with pytest.raises(SplitPointError):  # a ValueError of its own (below)
        Pipe(Shaped(), split_points=["embed"], devices=["cpu"] * 2, sample=sample)
    assert split_candidates(Shaped()) == [
        "embed", "blocks", "head", "blocks.0", "blocks.1", "blocks.2"
    ]  # fmt: skip


def test_torch_exports_own_value_errors_are_worded_as_export_failures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        # A ValueError raised inside torch, as torch.export's own are.
        spec = pytree.tree_flatten((1, 2))[1]
        pytree.tree_unflatten([1], spec)

    monkeypatch.setattr(export, "exported_graph", refuse)
    with pytest.raises(TypeError, match="torch.export could not export Shaped: ValueError: "):
        Pipe(Shaped(), split_points=["blocks.1"], devices=["cpu"] * 2, tracer="export",
             sample={"x": torch.randn(2, 4)})  # fmt: skip


class _Checks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is not None and mask.dtype != torch.bool:
            raise ValueError("mask must be a bool tensor")
        return self.b(self.a(x))


def test_the_models_own_value_error_reaches_the_user_as_it_is() -> None:
    with pytest.raises(ValueError, match="^mask must be a bool tensor$"):
        Pipe(_Checks(), split_points=["b"], devices=["cpu"] * 2, tracer="export",
             sample={"x": torch.randn(4, 4), "mask": torch.ones(4)})  # fmt: skip


@pytest.mark.filterwarnings("ignore:Using a target size")  # mse_loss's, while exported
def test_inputs_of_different_batch_sizes_are_named_when_their_export_fails() -> None:
    pipe = Pipe(Shaped(), chunks=2, split_points=["head"], devices=["cpu"] * 2,
                sample={"x": torch.randn(4, 4)})  # fmt: skip
    with pytest.raises(ValueError, match=r"different batch sizes \(dim 0\): \[3, 5\]"):
        pipe(torch.randn(5, 4), torch.randn(3, 2))  # a new kind of call: exported first


def test_train_step_without_loss_fn_needs_a_module_that_returns_its_loss() -> None:
    fx = Pipe(Fan(), split_points=["b"], devices=["cpu"] * 2)
    with pytest.raises(TypeError, match="train_step needs a loss_fn"):
        fx.train_step(torch.randn(2, 4))
    pipe = Pipe(Shaped(), split_points=["head"], devices=["cpu"] * 2,
                sample={"x": torch.randn(2, 4)})  # fmt: skip
    with pytest.raises(TypeError, match="returned no loss"):
        pipe.train_step({"x": torch.randn(2, 4)})

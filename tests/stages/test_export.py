"""Modules split by torch.export: where torch.fx fails or when asked, the
stages equal the unsplit module (outputs, loss, every gradient) on every
schedule and checkpoint mode; the split report says which tracer and why;
every failure names the module, the tracer and what to do."""

from __future__ import annotations

import copy
import pickle

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


class Normed(nn.Module):
    """BatchNorm exported: an aten operator on the stage's own buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        self.b = nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))  # type: ignore[no-any-return]


def exported_norm(checkpoint: str, chunks: int, split: str = "b") -> Pipe:
    sample = torch.randn(4, 2, dtype=torch.float64)
    return Pipe(Normed().double(), chunks=chunks, split_points=[split], devices=["cpu"] * 2,
                checkpoint=checkpoint, tracer="export", sample=sample)  # fmt: skip


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_an_exported_batch_norm_updates_its_statistics_once(checkpoint: str) -> None:
    # The recomputation of a checkpointed stage must leave them as they were.
    pipe = exported_norm(checkpoint, chunks=1)
    ref = copy.deepcopy(pipe.a).train()
    x = torch.randn(4, 2, dtype=torch.float64)
    pipe(x).sum().backward()
    ref(x)
    for name, buffer in ref.named_buffers():
        torch.testing.assert_close(pipe.a.get_buffer(name), buffer, msg=name)


@pytest.mark.parametrize("split", ["b", "a.1"])  # a norm inside a stage, or beginning one
def test_an_exported_batch_norm_refuses_one_value_per_channel(split: str) -> None:
    # Eager BatchNorm refuses it in Python; the aten operator would give NaN.
    pipe = exported_norm("never", chunks=4, split=split)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        pipe(torch.randn(4, 2, dtype=torch.float64))
    pipe.eval()
    assert pipe(torch.randn(1, 2, dtype=torch.float64)).shape == (1, 2)


def test_an_exported_batch_norm_pipe_pickles_with_its_check() -> None:
    # Loading a stage traces its code again, the inserted check included.
    pipe = exported_norm("never", chunks=2)
    x = torch.randn(4, 2, dtype=torch.float64)
    pipe(x)
    loaded = pickle.loads(pickle.dumps(pipe))
    torch.testing.assert_close(loaded(x), pipe(x))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        loaded(torch.randn(2, 2, dtype=torch.float64))


class _Extras(nn.Module):
    """Takes extra keyword arguments (as a Hugging Face forward does)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, input_ids: Tensor, **kwargs: Tensor) -> Tensor:
        h = self.a(input_ids)
        if "scale" in kwargs:
            h = h * kwargs["scale"]
        return self.b(h)


def test_train_step_passes_a_batchs_extra_keys_to_kwargs() -> None:
    torch.manual_seed(0)
    model = _Extras().double()
    x, s = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    y = torch.randn(6, 2, dtype=torch.float64)
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=2,
        tracer="export", sample={"input_ids": x, "scale": s},
    )  # fmt: skip
    loss = pipe.train_step({"input_ids": x, "scale": s}, y, nn.functional.mse_loss)
    expected = nn.functional.mse_loss(model(x, scale=s), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, model)


def test_extra_keyword_arguments_run_on_micro_batches_of_any_size() -> None:
    torch.manual_seed(0)
    model = _Extras().double()
    x, s = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=2,
        tracer="export", sample={"input_ids": x, "scale": s},
    )  # fmt: skip
    torch.testing.assert_close(pipe(input_ids=x, scale=s), model(x, scale=s))  # 3 and 2 rows
    x, s = x.repeat(2, 1)[:7], s.repeat(2, 1)[:7]
    torch.testing.assert_close(pipe(input_ids=x, scale=s), model(x, scale=s))  # 4 and 3 rows
    assert len(pipe.split_report().exports) == 1


@pytest.mark.parametrize("key", ["pixel-values", "class"])
def test_a_keyword_torch_export_cannot_name_is_refused_by_name(key: str) -> None:
    x = torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match=rf"keyword argument '{key}'.*rename the key"):
        Pipe(
            _Extras().double(), split_points=["b"], devices=["cpu"] * 2, chunks=2,
            tracer="export", sample={"input_ids": x, key: x},
        )  # fmt: skip


class _OwnLoss(nn.Module):
    """Returns its own loss, reduced as ``how`` says."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.how = how

    def forward(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        h = self.b(torch.relu(self.a(x)))
        if self.how == "ce_sum":
            loss = nn.functional.cross_entropy(h, y, reduction="sum")
        elif self.how == "mse_sum":
            loss = nn.functional.mse_loss(h, nn.functional.one_hot(y, 4).double(), reduction="sum")
        else:  # a mean over the targets other than -100
            loss = nn.functional.nll_loss(nn.functional.log_softmax(h, -1), y)
        return {"loss": loss, "out": h}


@pytest.mark.parametrize("how", ["ce_sum", "mse_sum", "nll"])
def test_a_models_summed_or_nll_loss_adds_up_to_the_batchs(how: str) -> None:
    torch.manual_seed(0)
    model = _OwnLoss(how).double()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))
    y[:3] = -100 if how == "nll" else y[:3]  # micro-batch 0 has no target to count
    batch = {"x": x, "y": y}
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=4,
        tracer="export", sample=batch,
    )  # fmt: skip
    expected = model(x, y)["loss"]
    torch.testing.assert_close(pipe(**batch)["loss"], expected)
    loss = pipe.train_step(batch)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, model)


def test_a_mapping_batch_and_keyword_order_are_one_kind_of_call() -> None:
    from collections import UserDict  # a tokenizer's BatchEncoding is one

    torch.manual_seed(0)
    model = _Extras().double()
    x, s = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    y = torch.randn(6, 2, dtype=torch.float64)
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=2,
        tracer="export", sample=UserDict({"input_ids": x, "scale": s}),
    )  # fmt: skip
    pipe.train_step(UserDict({"input_ids": x, "scale": s}), y, nn.functional.mse_loss)
    pipe(input_ids=x, scale=s, other=None)
    pipe(input_ids=x, other=None, scale=s)  # the same extras in another order
    assert len(pipe.split_report().exports) == 2  # with and without other=None

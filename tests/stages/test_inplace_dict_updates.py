"""A dict update traced by torch.fx (``batch |= {"t": h}``) sets keys and
writes into no tensor: a call holding one tensor under two keys runs as the
plain model does, what the code reads at a key it set is the value set
(``inplace_paths.updates`` and ``given``), and a change that does write
into a tensor shared by two keys, or into a value set, is still refused."""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from tests.helpers import assert_same_grads


class UpdatesItsBatch(nn.Module):
    """Sets keys of its dict batch in stage 0; stages 1 and 2 read the dict."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        h = self.a(batch["x"])
        if self.how == "ior":
            batch |= {"t": h * 2}
        elif self.how == "through-a-second-name":
            other = batch
            other |= {"t": h * 2}
        elif self.how == "set-x-then-change-it":
            batch |= {"x": h * 2, "t": h}
            batch["x"].add_(1)  # the value set, not the caller's x
        elif self.how == "update":
            batch.update(t=h * 2)
        k = self.b(h) * batch["t"] + batch["s"]
        return self.c(k) + batch["x"][:, 2:] * batch["s"][:, :2]  # type: ignore[no-any-return]


def _run(module: nn.Module, t: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The output on a batch holding a copy of ``t`` under two keys, the
    gradient of that copy, and the batch after the call."""
    x = t.clone().requires_grad_()
    batch = {"x": x, "s": x}
    out = module(batch)
    out.square().sum().backward()
    assert x.grad is not None
    return out, x.grad, batch


@pytest.mark.parametrize("how", ["ior", "through-a-second-name", "set-x-then-change-it",
                                 "update"])  # fmt: skip
@pytest.mark.parametrize("split_size", [2, 3])
@pytest.mark.parametrize("force_copies", [False, True])  # the dict sent to later stages
def test_a_dict_update_with_one_tensor_under_two_keys_runs_as_the_plain_model(
    how: str, split_size: int, force_copies: bool
) -> None:
    # The update was a change of every tensor in the batch: a call holding
    # t under "x" and "s" was refused as sharing memory with a changed input
    # ("update" passed before too: the check did not see it).
    torch.manual_seed(0)
    model = UpdatesItsBatch(how).double()
    pipe = Pipe(copy.deepcopy(model), split_points=["b", "c"], devices=["cpu"] * 3,
                split_size=split_size, tracer="fx", force_copies=force_copies)  # fmt: skip
    t = torch.randn(8, 4, dtype=torch.float64)
    out, grad, given = _run(pipe, t)
    expected, expected_grad, _ = _run(model, t)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad, expected_grad)
    assert_same_grads(pipe, model)
    assert sorted(given) == ["s", "x"] and given["x"] is given["s"]  # the caller's dict: as it was
    # The update copies no tensor of the batch, so no call is checked for sharing.
    assert not pipe.__dict__["_split"].current.changed.paths


class WritesASharedTensor(nn.Module):
    """Sets a key of its dict batch, and changes ``batch["x"]`` in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        batch |= {"t": batch["s"] * 2}
        batch["x"].add_(1)
        return self.b(self.a(batch["x"]) * batch["t"]) + batch["s"][:, :2]  # type: ignore[no-any-return]


@pytest.mark.parametrize("split_size", [2, 3])
def test_a_write_into_a_tensor_two_keys_hold_is_still_refused(split_size: int) -> None:
    torch.manual_seed(0)
    model = WritesASharedTensor().double()
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2,
                split_size=split_size, tracer="fx")  # fmt: skip
    t = torch.randn(8, 4, dtype=torch.float64)
    refused = (
        r"WritesASharedTensor.forward changes input batch\['x'\] in place, and input "
        r"batch\['s'\] of the same call shares its memory.*Pass input batch\['s'\] as a "
        r"tensor of its own \(.clone\(\)\)"
    )
    with pytest.raises(ValueError, match=refused):
        pipe({"x": t, "s": t})
    assert all(p.grad is None for p in pipe.parameters())  # refused before anything ran
    # Two tensors of their own: the plain model's results.
    batch: dict[str, Any] = {"x": t, "s": t.clone()}
    out = pipe({k: v.clone() for k, v in batch.items()})
    expected = model({k: v.clone() for k, v in batch.items()})
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_same_grads(pipe, model)


class ChangesAValueSet(nn.Module):
    """Sets ``batch["x"]`` to ``g`` in stage 0, changes it in place in stage 1,
    and reads ``g`` in stage 2."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        g = self.a(batch["x"]) * 2
        batch |= {"x": g}
        k = self.b(g)
        batch["x"].mul_(3)  # changes g: stage 2 reads it changed, in the module
        return self.c(k) + g[:, :2]  # type: ignore[no-any-return]


def test_a_change_of_a_value_a_dict_update_set_is_refused_where_a_later_stage_reads_it() -> None:
    # batch["x"] was taken for the input's x: the change of g in stage 1 went
    # unseen, and stage 2 read g unchanged where stages copy (force_copies,
    # other devices), a wrong result without a word.
    refused = r"'mul_' in stage 1 changes 'mul' in place, which stage 2 also reads"
    with pytest.raises(ValueError, match=refused):
        Pipe(ChangesAValueSet(), split_points=["b", "c"], devices=["cpu"] * 3, tracer="fx")


class UpdatesForALaterStage(nn.Module):
    """Sets ``batch["t"]`` in stage 0 or 1 (``where``), as ``how`` spells
    it; stage 2 reads it."""

    def __init__(self, how: str, where: int) -> None:
        super().__init__()
        self.how, self.where = how, where
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        h = self.a(batch["x"])
        for stage in (0, 1):
            if stage == 1:
                h = self.b(h)
            if stage != self.where:
                continue
            if self.how == "ior":
                batch |= {"t": h * 2}
            elif self.how == "update":
                batch.update(t=h * 2)
            else:
                batch.update({"t": h * 2})
        return self.c(h) * batch["t"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["ior", "update", "update-a-dict"])
@pytest.mark.parametrize("where", [0, 1])
@pytest.mark.parametrize("split_size", [2, 3])
@pytest.mark.parametrize("devices", [["cpu"] * 3, ["cpu:0", "cpu:1", "cpu:2"]])
@pytest.mark.parametrize("force_copies", [False, True])
def test_a_later_stage_reads_the_key_a_dict_update_set_however_it_is_spelled(
    how: str, where: int, split_size: int, devices: list[str], force_copies: bool
) -> None:
    # batch.update(...) was no change to the trace: stage 2 read its own copy
    # of the input dict (a stage on another device gets one), without "t"
    # (a KeyError) or with the caller's "t" (a wrong result without a word).
    torch.manual_seed(0)
    model = UpdatesForALaterStage(how, where).double()
    pipe = Pipe(copy.deepcopy(model), split_points=["b", "c"], devices=devices,
                split_size=split_size, tracer="fx", force_copies=force_copies)  # fmt: skip
    x = torch.randn(8, 4, dtype=torch.float64)
    for given in [{"x": x}, {"x": x, "t": x + 1}]:
        pipe.zero_grad()
        model.zero_grad()
        out, expected = pipe(dict(given)), model(dict(given))
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        assert_same_grads(pipe, model)


class Scales(NamedTuple):
    """No dict: its own ``update`` makes a new tensor."""

    scale: Tensor
    shift: Tensor

    def update(self, h: Tensor) -> Tensor:
        return h * self.scale + self.shift


class CallsAnObjectsUpdate(nn.Module):
    """Calls ``update`` of its namedtuple argument in stage 0 and reads the
    result and a field of it in stage 1."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor, scales: Scales) -> Tensor:
        g = scales.update(self.a(x))
        return self.b(g) * scales.scale  # type: ignore[no-any-return]


def test_an_update_method_of_an_argument_that_is_no_dict_is_called_as_the_module_calls_it() -> None:
    # It was recorded as a dict's update, whose result the trace took as None:
    # "linear(): argument 'input' (position 1) must be Tensor, not NoneType".
    torch.manual_seed(0)
    model = CallsAnObjectsUpdate().double()
    x = torch.randn(8, 4, dtype=torch.float64)
    scales = Scales(torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64))
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, split_size=4,
                tracer="fx", sample=(x, scales))  # fmt: skip
    out, expected = pipe(x, scales), model(x, scales)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_same_grads(pipe, model)
    # Without a call, the trace takes it for a dict's update, and says so.
    pipe = Pipe(CallsAnObjectsUpdate(), split_points=["b"], devices=["cpu"] * 2, tracer="fx")
    refused = (
        r"forward calls scales\.update\(\.\.\.\) on a Scales, which the trace took for a dict's "
        r"update.*pass Pipe\(\.\.\., sample=\.\.\.\), a call holding a Scales there"
    )
    with pytest.raises(TypeError, match=refused):
        pipe(x.float(), Scales(scales.scale.float(), scales.shift.float()))


class SetsKeysOfTheInnerDictByTwoNames(nn.Module):
    """Updates the dict its batch holds through a name of its own
    (``how``), then sets a key of it through the batch, in stage 0, or
    updates the batch through a second name in stage 1; reads what it set
    in stage 2, through the batch and through a name taken before."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: dict[str, Any]) -> Tensor:
        old = batch["inner"]
        h = self.a(batch["x"])
        inner = batch["inner"]
        if self.how == "second-name":  # in stage 1
            g = self.b(h)
            other = batch
            other |= {"t": g * 3}
            return self.c(g) * batch["t"] + old["u"]  # type: ignore[no-any-return]
        if self.how == "update":
            inner.update(k=h * 3)
        elif self.how == "ior":
            inner |= {"k": h * 3}
        else:
            inner["k"] = h * 3
        batch["inner"]["s"] = h
        k = self.c(self.b(h)) * batch["inner"]["s"] + batch["inner"]["k"]
        return k + old["k"] + batch["inner"]["u"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["update", "ior", "set-a-key", "second-name"])
@pytest.mark.parametrize("sample", [False, True])
def test_keys_set_through_two_names_of_one_dict_reach_the_later_stages(
    how: str, sample: bool
) -> None:
    # Without a call given, the update through a name of its own left the
    # batch "changed", so batch["inner"] was no item of it any more:
    # "'AugmentedProxy' object does not support item assignment" (and a
    # read through another name than the one updated was refused: a value
    # set, read by either name, is the value set).
    torch.manual_seed(0)
    model = SetsKeysOfTheInnerDictByTwoNames(how).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = Pipe(copy.deepcopy(model), split_points=["b", "c"], devices=["cpu"] * 3,
                split_size=2, tracer="fx",
                sample=({"x": x, "inner": {"u": x}},) if sample else None)  # fmt: skip
    inner = {"u": x + 1}
    out, expected = pipe({"x": x, "inner": inner}), model({"x": x, "inner": {"u": x + 1}})
    torch.testing.assert_close(out, expected)
    assert list(inner) == ["u"]  # the caller's dict: as it was
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_same_grads(pipe, model)


class SetsKeysInOneStageReadInLater(nn.Module):
    """Sets a key of the batch through a second name in the stage of ``b``,
    and one of its inner dict through the batch in the stage of ``c``;
    reads both through every name, those taken before included."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: dict[str, Any]) -> Tensor:
        inner = batch["inner"]
        other = batch
        g = self.b(self.a(batch["x"]))
        other.update(t=g)
        h = self.c(g)
        batch["inner"].update(k=h)
        return h * other["t"] + batch["t"] + inner["k"] * batch["inner"]["u"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("points", [["b", "c"], ["b"], ["c"]])
@pytest.mark.parametrize("force_copies", [False, True])
def test_keys_set_without_a_sample_read_in_later_stages_train_as_the_plain_model(
    points: list[str], force_copies: bool
) -> None:
    # Before the keys an update sets were known with no sample=, the run
    # raised KeyError: 'k' where the plain model runs (the last stage's
    # read of the key set, split from the update).
    torch.manual_seed(0)
    model = SetsKeysInOneStageReadInLater().double()
    pipe = Pipe(copy.deepcopy(model), split_points=points, devices=["cpu"] * (len(points) + 1),
                split_size=2, tracer="fx", force_copies=force_copies)  # fmt: skip
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    out = pipe({"x": x, "inner": {"u": x + 1}})
    torch.testing.assert_close(out, model({"x": x, "inner": {"u": x + 1}}))
    loss = pipe.train_step({"x": x, "inner": {"u": x + 1}}, y, nn.MSELoss())
    want = nn.MSELoss()(model({"x": x, "inner": {"u": x + 1}}), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    assert_same_grads(pipe, model)


class UpdatesTheInnerDictAcrossAStage(nn.Module):
    """Takes the dict its batch holds by a name in stage 0 and sets a key of
    it (``how``); stage 1 sets another through the batch (``later``: or sets
    the first through that name) and reads both by either name."""

    def __init__(self, how: str, later: str) -> None:
        super().__init__()
        self.how, self.later = how, later
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: dict[str, Any]) -> Tensor:
        inner = batch["inner"]
        h = self.a(batch["x"] + inner["u"])
        if self.later == "through-the-batch":
            _set(inner, "k", h, self.how)
        g = self.b(h)
        if self.later == "through-the-batch":
            batch["inner"]["s"] = g
        else:
            _set(inner, "k", g, self.how)
            batch["inner"]["s"] = g * 2
        k = batch["inner"]["k"] * inner["s"] + inner["k"] * batch["inner"]["s"]
        return g * k  # type: ignore[no-any-return]


def _set(inner: dict[str, Tensor], key: str, value: Tensor, how: str) -> None:
    if how == "update":
        inner.update({key: value})
    elif how == "ior":
        inner |= {key: value}
    else:
        inner[key] = value


@pytest.mark.parametrize("how", ["update", "ior", "set-a-key"])
@pytest.mark.parametrize("later", ["through-the-batch", "through-the-first-name"])
@pytest.mark.parametrize("sample", [False, True])
def test_a_dict_updated_in_one_stage_and_set_and_read_in_the_next_trains_as_the_plain_model(
    how: str, later: str, sample: bool
) -> None:
    # Both were refused: the write-back of stage 1's change into the batch
    # (batch |= {"inner": inner}) was taken for a read of the batch stage 1
    # received apart from the dict, with advice about "a name taken before
    # the change" that the module does not use.
    torch.manual_seed(0)
    model = UpdatesTheInnerDictAcrossAStage(how, later).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, split_size=2,
                tracer="fx", sample=({"x": x, "inner": {"u": x}},) if sample else None)  # fmt: skip
    out, expected = pipe({"x": x, "inner": {"u": x + 1}}), model({"x": x, "inner": {"u": x + 1}})
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_same_grads(pipe, model)

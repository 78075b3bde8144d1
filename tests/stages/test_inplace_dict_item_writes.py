"""``batch[k] = v`` on a dict argument (or a dict in one) traced by
torch.fx takes the path ``batch |= {k: v}`` takes: the stages after it read
the dict the writing stage returns, as the plain model reads its dict; a
write torch.fx cannot follow is refused by name, and so is a dict update
through a second name that a later stage misses, with advice that fits."""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from mpstream import Pipe
from tests.helpers import assert_same_grads


class WritesAKey(nn.Module):
    """Writes a key of its dict batch in stage 0 or 1 (``where``), as
    ``how`` spells it; stage 2 reads it."""

    def __init__(self, how: str, where: int) -> None:
        super().__init__()
        self.how, self.where = how, where
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: dict[str, object]) -> Tensor:
        h = self.a(batch["x"])
        for stage in (0, 1):
            if stage == 1:
                h = self.b(h)
            if stage != self.where:
                continue
            if self.how == "add-a-key":
                batch["t"] = h * 2
            elif self.how == "replace-a-key":
                batch["x"] = h * 2
            elif self.how == "update-a-nested-dict":
                batch["inner"] |= {"t": h * 2}  # type: ignore[operator]
            else:
                batch["inner"]["t"] = h * 2  # type: ignore[index]
        if self.how == "replace-a-key":
            return self.c(h) * batch["x"]  # type: ignore[no-any-return]
        if self.how == "add-a-key":
            return self.c(h) * batch["t"]  # type: ignore[no-any-return]
        inner = batch["inner"]
        return self.c(h) * inner["t"] + inner["u"]  # type: ignore[index,no-any-return]


@pytest.mark.parametrize(
    "how", ["add-a-key", "replace-a-key", "update-a-nested-dict", "set-a-key-of-a-nested-dict"]
)
@pytest.mark.parametrize("where", [0, 1])
@pytest.mark.parametrize("split_size", [2, 3])
@pytest.mark.parametrize("devices", [["cpu"] * 3, ["cpu:0", "cpu:1", "cpu:2"]])
@pytest.mark.parametrize("sample", [False, True])  # the keys then answered from the call
def test_a_key_written_into_a_dict_argument_reaches_the_later_stages(
    how: str, where: int, split_size: int, devices: list[str], sample: bool
) -> None:
    # torch.fx's proxy has no __setitem__: "'AugmentedProxy' object does not
    # support item assignment" before anything was split.
    torch.manual_seed(0)
    model = WritesAKey(how, where).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = Pipe(copy.deepcopy(model), split_points=["b", "c"], devices=devices,
                split_size=split_size, tracer="fx",
                sample=({"x": x, "inner": {"u": x}},) if sample else None)  # fmt: skip
    inner = {"u": x + 1}
    given = {"x": x, "inner": inner}
    out = pipe(given)
    expected = model({"x": x, "inner": {"u": x + 1}})
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_same_grads(pipe, model)
    # The caller's dicts: as they were.
    assert given == {"x": x, "inner": inner} and given["x"] is x and given["inner"] is inner
    assert list(inner) == ["u"]


class WritesIntoAList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: list[Tensor]) -> Tensor:
        batch[1] = self.a(batch[0])
        return self.b(batch[1])  # type: ignore[no-any-return]


def test_an_item_written_into_a_list_argument_is_refused_by_name() -> None:
    x = torch.randn(8, 4)
    with pytest.raises(
        TypeError,
        match=re.escape("forward sets batch[1], which a trace takes for a dict's key")
        + ".*pass Pipe.*sample=",
    ):
        Pipe(WritesIntoAList(), split_points=["b"], devices=["cpu"] * 2, tracer="fx")
    refused = re.escape("forward sets batch[1], an item of a list in the call, which torch.fx")
    with pytest.raises(TypeError, match=refused + r".*pass tracer='export'"):
        Pipe(WritesIntoAList(), split_points=["b"], devices=["cpu"] * 2, tracer="fx",
             sample=([x, x],))  # fmt: skip


class UpdatesThroughASecondName(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        h = self.b(self.a(batch["x"]))
        other = batch
        # A list: no value a trace answers a later read with (a tensor it
        # answers, and the module runs: test_inplace_dict_updates.py).
        other |= {"t": [h * 2]}
        return self.c(h) * batch["t"][0]  # type: ignore[no-any-return]


def test_a_dict_update_a_later_stage_misses_is_refused_with_advice_for_a_dict() -> None:
    # The advice was "make that operation out of place (inplace=False)",
    # which a dict update has no form of.
    refused = (
        re.escape("'ior' in stage 1 changes batch['t'] in place, which stage 2 also reads")
        + r".*Update batch by its own name \(batch \|= \{\.\.\.\} or batch\[key\] = value"
    )
    with pytest.raises(ValueError, match=refused) as raised:
        Pipe(UpdatesThroughASecondName(), split_points=["b", "c"], devices=["cpu"] * 3,
             tracer="fx")  # fmt: skip
    assert "inplace=False" not in str(raised.value)


class WritesThroughTheInnerDict(nn.Module):
    """Reads the dict its batch holds into a name of its own, and sets a
    key of it as ``how`` spells it, in stage 0 or 1 (``where``); the last
    stage reads the key through the batch."""

    def __init__(self, how: str, where: int) -> None:
        super().__init__()
        self.how, self.where = how, where
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: dict[str, Any]) -> Tensor:
        h = self.a(batch["x"])
        for stage in (0, 1):
            if stage == 1:
                h = self.b(h)
            if stage != self.where:
                continue
            inner = batch["inner"]
            if self.how == "ior":
                inner |= {"t": h * 2}
            elif self.how == "set-a-key":
                inner["t"] = h * 2
            else:
                inner.update(t=h * 2)
        return self.c(h) * batch["inner"]["t"] + batch["inner"]["u"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["ior", "set-a-key", "update"])
@pytest.mark.parametrize("stages", [2, 3])  # 2: written in stage 0, read in 1; 3: in 1, read in 2
@pytest.mark.parametrize("split_size", [2, 3])
@pytest.mark.parametrize("apart", [False, True])  # a device per stage: each gets its own copy
@pytest.mark.parametrize("sample", [False, True])
def test_a_key_set_through_the_name_of_a_dict_the_batch_holds_reaches_the_later_stages(
    how: str, stages: int, split_size: int, apart: bool, sample: bool
) -> None:
    # inner |= {...} and inner.update(...) in stage 1 of 3 were refused ("Update
    # batch by its own name"): the batch the last stage read was stage 0's.
    torch.manual_seed(0)
    model = WritesThroughTheInnerDict(how, where=stages - 2).double()
    devices = [f"cpu:{i}" for i in range(stages)] if apart else ["cpu"] * stages
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = Pipe(copy.deepcopy(model), split_points=["b", "c"][3 - stages :], devices=devices,
                split_size=split_size, tracer="fx",
                sample=({"x": x, "inner": {"u": x}},) if sample else None)  # fmt: skip
    for held in [{}, {"t": x - 1}]:  # the call's own "t": never read
        pipe.zero_grad()
        model.zero_grad()
        out = pipe({"x": x, "inner": {"u": x + 1, **held}})
        expected = model({"x": x, "inner": {"u": x + 1, **held}})
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        assert_same_grads(pipe, model)


class Held(NamedTuple):
    x: Tensor
    inner: dict[str, Tensor]


@dataclasses.dataclass
class HeldData:
    x: Tensor
    inner: dict[str, Tensor]


pytree.register_dataclass(HeldData)


class WritesThroughAField(nn.Module):
    """Reads the dict its namedtuple or dataclass batch holds in a field
    into a name of its own and sets a key of it as ``how`` spells it, in
    stage 0 or 1 (``where``); the last stage reads the key through the batch."""

    def __init__(self, how: str, where: int) -> None:
        super().__init__()
        self.how, self.where = how, where
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: Held | HeldData) -> Tensor:
        h = self.a(batch.x)
        for stage in (0, 1):
            if stage == 1:
                h = self.b(h)
            if stage != self.where:
                continue
            inner = batch.inner
            if self.how == "ior":
                inner |= {"t": h * 2}
            elif self.how == "set-a-key":
                inner["t"] = h * 2
            else:
                inner.update(t=h * 2)
        return self.c(h) * batch.inner["t"] + batch.inner["u"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["ior", "set-a-key", "update"])
@pytest.mark.parametrize("stages", [2, 3])  # 2: written in stage 0, read in 1; 3: in 1, read in 2
@pytest.mark.parametrize("kind", [Held, HeldData])
@pytest.mark.parametrize("sample", [False, True])
def test_a_key_set_in_a_dict_a_field_holds_reaches_the_later_stages(
    how: str, stages: int, kind: type[Held | HeldData], sample: bool
) -> None:
    # inner |= {...} and inner.update(...) in stage 1 of 3 were refused ("held
    # in batch where a trace cannot write it back"), and inner["t"] = v in any
    # stage ("a dict held in a field"): batch["inner"] of a dict batch ran.
    torch.manual_seed(0)
    model = WritesThroughAField(how, where=stages - 2).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = Pipe(copy.deepcopy(model), split_points=["b", "c"][3 - stages :],
                devices=[f"cpu:{i}" for i in range(stages)], split_size=2, tracer="fx",
                sample=(kind(x, {"u": x}),) if sample else None)  # fmt: skip
    inner = {"u": x + 1}
    out, expected = pipe(kind(x, inner)), model(kind(x, {"u": x + 1}))
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_same_grads(pipe, model)
    assert list(inner) == ["u"]  # the caller's dict: as it was


class Box:
    """A batch pytree knows by its registration alone (no namedtuple, no
    dataclass): forward reads its attributes."""

    def __init__(self, x: Tensor, inner: dict[str, Tensor]) -> None:
        self.x, self.inner = x, inner


pytree.register_pytree_node(
    Box,
    lambda b: ([b.x, b.inner], None),
    lambda children, _: Box(*children),
    flatten_with_keys_fn=lambda b: (
        [(pytree.GetAttrKey("x"), b.x), (pytree.GetAttrKey("inner"), b.inner)],
        None,
    ),
)


@pytest.mark.parametrize("how", ["ior", "set-a-key", "update"])
@pytest.mark.parametrize("stages", [2, 3])
def test_a_key_set_in_a_dict_a_registered_objects_attribute_holds_runs_with_no_sample(
    how: str, stages: int
) -> None:
    # A trace with no call recorded the write-back as a namedtuple's or
    # dataclass's copy, which raised TypeError for a Box at run time, in the
    # writing stage, after the stages before it had run (|= and .update
    # in stage 0 of 2 ran before the write-back).
    torch.manual_seed(0)
    model = WritesThroughAField(how, where=stages - 2).double()
    x = torch.randn(7, 4, dtype=torch.float64)
    pipe = Pipe(copy.deepcopy(model), split_points=["b", "c"][3 - stages :],
                devices=[f"cpu:{i}" for i in range(stages)], split_size=2, tracer="fx")  # fmt: skip
    out, expected = pipe(Box(x, {"u": x + 1})), model(Box(x, {"u": x + 1}))  # type: ignore[arg-type]
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_same_grads(pipe, model)


class WritesADictInAList(nn.Module):
    """Sets a key of the dict its list batch holds first, as ``how`` spells
    it, in stage 0 or 1 (``where``); the last stage reads it."""

    def __init__(self, how: str, where: int) -> None:
        super().__init__()
        self.how, self.where = how, where
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: list[Any]) -> Tensor:
        h = self.a(batch[1])
        for stage in (0, 1):
            if stage == 1:
                h = self.b(h)
            if stage != self.where:
                continue
            held = batch[0]
            if self.how == "ior":
                held |= {"t": h * 2}
            elif self.how == "set-a-key":
                held["t"] = h * 2
            else:
                held.update(t=h * 2)
        return self.c(h) * batch[0]["t"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["ior", "set-a-key", "update"])
@pytest.mark.parametrize("sample", [False, True])
def test_a_dict_in_a_list_runs_where_the_copying_stage_sets_it_and_is_refused_by_name_elsewhere(
    how: str, sample: bool
) -> None:
    # held["t"] = v was refused as a write into the list ("forward sets
    # batch[0]") even where the stage that copies the batch sets it; in a
    # later stage every spelling was told to "Update batch by its own name"
    # (batch[0] = ... on a list, which a trace cannot record).
    torch.manual_seed(0)
    x = torch.randn(8, 4, dtype=torch.float64)
    given = ([{"u": x}, x],) if sample else None
    model = WritesADictInAList(how, where=0).double()
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu:0", "cpu:1"],
                split_size=2, tracer="fx", sample=given)  # fmt: skip
    out, expected = pipe([{"u": x}, x]), model([{"u": x}, x])
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_same_grads(pipe, model)
    refused = r"where a trace cannot write it back \(in a list or a field\): pass tracer='export'"
    with pytest.raises(ValueError, match=refused) as raised:
        Pipe(WritesADictInAList(how, where=1), split_points=["b", "c"], devices=["cpu"] * 3,
             tracer="fx", sample=given)  # fmt: skip
    assert "by its own name" not in str(raised.value)
    # Named as the code reaches it: it was "item ['t'] of 'batch'", the list's index lost.
    assert f"'{_NAMES[how]}' in stage 1 changes batch[0]['t'] in place" in str(raised.value)


_NAMES = {"ior": "ior", "set-a-key": "update", "update": "update"}


class ReadsTheDictByANameTakenBefore(nn.Module):
    """Takes its batch's dict (a dict's item or a namedtuple's field) by a
    name in stage 0, sets a key of it through a name taken anew in stage 1,
    and reads the key through the first name in stage 2."""

    def __init__(self, field: bool) -> None:
        super().__init__()
        self.field = field
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def held(self, batch: Any) -> dict[str, Tensor]:
        return batch.inner if self.field else batch["inner"]  # type: ignore[no-any-return]

    def forward(self, batch: Any) -> Tensor:
        old = self.held(batch)
        h = self.b(self.a(old["u"]))
        inner = self.held(batch)
        inner |= {"t": [h * 2]}  # a list: as in UpdatesThroughASecondName
        return self.c(h) * old["t"][0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("field", [False, True])
def test_a_key_read_through_a_name_taken_before_it_was_set_is_refused_saying_so(
    field: bool,
) -> None:
    # The error said the dict was "held in batch where a trace cannot write it
    # back (in a list or a field): pass tracer='export'": it was written back,
    # and read through a name taken before.
    with pytest.raises(ValueError) as raised:
        Pipe(ReadsTheDictByANameTakenBefore(field), split_points=["b", "c"],
             devices=["cpu"] * 3, tracer="fx")  # fmt: skip
    message = str(raised.value)
    assert "cannot write it back" not in message, message
    assert "through its view 'getattr_1'" in message or "through its view 'getitem'" in message
    assert "by a name taken after the change" in message, message

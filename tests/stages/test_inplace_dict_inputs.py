"""A call whose dicts a traced forward updates in place is checked before
anything runs (``ChangedInputs.check``, ``inplace.updated_inputs``): one
dict held at two places, which the pipeline's micro-batches would hold
apart, and a ``.update`` the trace took for a dict's on what is no dict,
are refused by name with what to do; nothing has run (no running
statistics, no gradients)."""

from __future__ import annotations

import copy
import re
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from tests.helpers import assert_same_grads


class UpdatesOneOfTwo(nn.Module):
    """Sets ``"t"`` in the dict at ``batch["p"]`` (as ``how`` spells it) in
    stage 0 or 1 (``where``), after a BatchNorm in stage 0; the last stage
    reads it through ``batch["q"]`` where ``read`` says so, else through ``p``."""

    def __init__(self, how: str, where: int, read: str = "q") -> None:
        super().__init__()
        self.how, self.where, self.read = how, where, read
        self.a, self.n = nn.Linear(4, 4), nn.BatchNorm1d(4)
        self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: dict[str, Any]) -> Tensor:
        h = self.n(self.a(batch["x"]))
        for stage in (0, 1):
            if stage == 1:
                h = self.b(h)
            if stage != self.where:
                continue
            if self.how == "ior":
                batch["p"] |= {"t": h * 2}
            elif self.how == "set-a-key":
                batch["p"]["t"] = h * 2
            else:
                batch["p"].update(t=h * 2)
        return self.c(h) * batch[self.read]["t"] + batch["p"]["u"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["ior", "set-a-key", "update"])
@pytest.mark.parametrize("stages", [2, 3])  # 2: set in stage 0, read in 1; 3: in 1, read in 2
@pytest.mark.parametrize("sample", [False, True])
def test_a_dict_held_at_two_places_that_forward_updates_is_refused_before_anything_runs(
    how: str, stages: int, sample: bool
) -> None:
    # It failed while the stages ran, with "KeyError: 't'": each micro-batch
    # held a dict of its own at "p" and at "q", so "q" missed the update.
    torch.manual_seed(0)
    x = torch.randn(8, 4, dtype=torch.float64)
    model = UpdatesOneOfTwo(how, where=stages - 2).double()
    piped = copy.deepcopy(model)
    pipe = Pipe(piped, split_points=["b", "c"][3 - stages :],
                devices=["cpu"] * stages, split_size=2, tracer="fx",
                sample=({"x": x, "p": {"u": x}, "q": {"u": x}},) if sample else None)  # fmt: skip
    shared = {"u": x + 1}
    refused = re.escape(
        "UpdatesOneOfTwo.forward updates the dict input batch['p'] in place, and input "
        "batch['q'] of the same call is that same dict"
    )
    with pytest.raises(ValueError, match=refused + r".*Hold the dict at one place"):
        pipe.train_step({"x": x, "p": shared, "q": shared}, x, nn.functional.mse_loss)
    # Nothing ran: no statistics, no gradients, the caller's dict as it was.
    assert int(piped.n.num_batches_tracked) == 0 and not piped.n.running_mean.any()
    assert all(p.grad is None for p in piped.parameters())
    assert list(shared) == ["u"]
    # A dict of its own at each place runs as the module does (it reads "t" at
    # "p"; the norm by its statistics, which micro-batches of their own would change).
    model.read = piped.read = "p"
    pipe = Pipe(piped, split_points=["b", "c"][3 - stages :], devices=["cpu"] * stages,
                split_size=2, tracer="fx").eval()  # fmt: skip
    model.eval()
    out = pipe({"x": x, "p": {"u": x + 1}, "q": {"u": x + 1}})
    expected = model({"x": x, "p": {"u": x + 1}, "q": {"u": x + 1}})
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_same_grads(pipe, model)


def test_a_dict_held_at_two_places_runs_where_forward_changes_neither() -> None:
    torch.manual_seed(0)
    model = ReadsTwice().double()
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, split_size=2,
                tracer="fx")  # fmt: skip
    x = torch.randn(8, 4, dtype=torch.float64)
    shared = {"u": x}
    out, expected = pipe({"p": shared, "q": shared}), model({"p": shared, "q": shared})
    torch.testing.assert_close(out, expected)


class ReadsTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: dict[str, dict[str, Tensor]]) -> Tensor:
        return self.b(self.a(batch["p"]["u"])) + batch["q"]["u"]  # type: ignore[no-any-return]


class Scales(NamedTuple):
    """No dict: its own ``update`` makes a new tensor."""

    scale: Tensor
    shift: Tensor

    def update(self, h: Tensor) -> Tensor:
        return h * self.scale + self.shift


class NormsThenCallsUpdate(nn.Module):
    """A BatchNorm, then ``update`` of its namedtuple argument, in stage 0."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.n, self.b = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)

    def forward(self, x: Tensor, scales: Scales) -> Tensor:
        g = scales.update(self.n(self.a(x)))
        return self.b(g) * scales.scale  # type: ignore[no-any-return]


def test_an_update_of_no_dict_traced_without_a_call_is_refused_before_anything_runs() -> None:
    # It was refused while stage 0 ran its first micro-batch: the BatchNorm's
    # statistics had counted it, and the error named no argument.
    model = NormsThenCallsUpdate()
    pipe = Pipe(model, split_points=["b"], devices=["cpu"] * 2, chunks=2, tracer="fx")
    x = torch.randn(8, 4)
    refused = (
        re.escape(
            "forward calls scales.update(...) on a Scales, which the trace took for a dict's update"
        )
        + r".*pass Pipe\(\.\.\., sample=\.\.\.\), a call holding a Scales there"
    )
    with pytest.raises(TypeError, match=refused):
        pipe.train_step((x, Scales(x, x)), x, nn.functional.mse_loss)
    assert int(model.n.num_batches_tracked) == 0 and not model.n.running_mean.any()
    assert all(p.grad is None for p in model.parameters())


class Fields(NamedTuple):
    x: Tensor
    inner: dict[str, Tensor]


class SetsTwoKeysThroughAField(nn.Module):
    """Sets two keys of the dict its namedtuple batch holds in a field, the
    second as ``how`` spells it, in stage 0; stage 1 reads both."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: Fields) -> Tensor:
        h = self.a(batch.x)
        inner = batch.inner
        inner["t"] = h * 2
        inner = batch.inner  # read again: the batch that holds "t"
        if self.how == "set-a-key":
            inner["s"] = h * 3
        else:
            inner.update(s=h * 3)
        return self.b(h) * batch.inner["t"] + batch.inner["s"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["set-a-key", "update"])
@pytest.mark.parametrize("sample", [False, True])
def test_a_second_key_set_in_a_fields_dict_is_checked_where_it_is_held(
    how: str, sample: bool
) -> None:
    # The input check lost the field stepping back through the first
    # write-back (batch.inner of the batch replaced) and refused
    # "batch.update(...) on a Fields", as if batch itself were updated.
    torch.manual_seed(0)
    model = SetsTwoKeysThroughAField(how).double()
    x = torch.randn(7, 4, dtype=torch.float64)
    given = (Fields(x, {"u": x}),) if sample else None
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu:0", "cpu:1"],
                split_size=2, tracer="fx", sample=given)  # fmt: skip
    out, expected = pipe(Fields(x, {"u": x})), model(Fields(x, {"u": x}))
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_same_grads(pipe, model)

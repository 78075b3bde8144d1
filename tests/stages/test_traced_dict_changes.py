"""A dict ``forward`` changes as it reads it, traced by torch.fx:
``batch.pop("s", d)`` and ``batch.setdefault("s", v)`` are answered from
the call where the module leaves the dict as it is (a key left out popped,
a key held as None set by default), and a dict changed in place through a
second name (``other = batch; other |= {...}``) is no longer answered from
the call through either name; a later stage reads the dict as changed.
Outputs, gradients and ``train_step``'s loss equal the plain module's for
every kind of call, and the caller's dict is left as it was: each
micro-batch's dict is the pipe's own."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from tests.stages.test_traced import fx_split
from tests.stages.test_traced_items import ReadAs


def _alias_then_get(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
    other = batch
    other |= {"s": batch["x"] * 3}
    return batch["x"], batch.get("s")


def _alias_then_get_other(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
    other = batch
    other |= {"s": batch["x"] * 3}
    return batch["x"], other.get("s", None)


def _pop_then_get(batch: dict[str, Tensor]) -> tuple[Tensor, Any]:
    batch.pop("s", None)
    return batch["x"], batch.get("s", 0.5)  # gone, whatever the call held


def _pop_then_get_it(batch: dict[str, Tensor]) -> tuple[Tensor, Any]:
    s = batch.pop("s", None)
    later = batch.get("s")  # gone: None, whatever the call held
    return batch["x"], s if later is None else later


def _pop_other_then_get(batch: dict[str, Tensor]) -> tuple[Tensor, Any]:
    x = batch.pop("x")
    return x, batch.get("s")  # "s" is still as the call holds it


def _pop_twice(batch: dict[str, Tensor]) -> tuple[Tensor, Any]:
    s = batch.pop("s", None)
    again = batch.pop("s", None)
    return batch["x"], s if again is None else again


def _setdefault_a_list(batch: dict[str, Any]) -> tuple[Tensor, Any]:
    batch.setdefault("extra", []).append(batch["x"] * 2)  # the dict's own list
    return batch["x"], batch["extra"][0]


def _setdefault_then_get_other(batch: dict[str, Any]) -> tuple[Tensor, Any]:
    batch.setdefault("t", 1.5)
    return batch["x"] * batch["t"], batch.get("s")  # "s" is still as the call holds it


def _setdefault_flag_then_pop(batch: dict[str, Any]) -> tuple[Tensor, Any]:
    batch.setdefault("flag", True)
    return batch["x"], batch["x"] if batch.pop("flag", False) else None


READS: dict[str, Callable[[dict[str, Any]], tuple[Tensor, Any]]] = {
    "pop-None": lambda b: (b["x"], b.pop("s", None)),
    "pop-default": lambda b: (b["x"], b.pop("s", 0.5)),
    "pop-then-get": _pop_then_get,
    "setdefault-None": lambda b: (b["x"], b.setdefault("s", None)),
    "setdefault-value": lambda b: (b["x"], b.setdefault("s", b["x"] * 2)),
    "alias-then-get": _alias_then_get,
    "alias-then-get-other": _alias_then_get_other,
    "pop-then-get-it": _pop_then_get_it,
    "pop-other-then-get": _pop_other_then_get,
    "pop-twice": _pop_twice,
    "setdefault-a-list": _setdefault_a_list,
    "setdefault-then-get-other": _setdefault_then_get_other,
}

# "s" given, held as None, left out: each kind twice, in a mixed order.
SHIFTS = ["given", "None", "left out", "given", "left out", "None"]


def _batch(x: Tensor, s: Tensor, shift: str) -> dict[str, Any]:
    if shift == "left out":
        return {"x": x.clone()}
    return {"x": x.clone(), "s": s.clone() if shift == "given" else None}


def _grads_equal(pipe: nn.Module, model: nn.Module) -> None:
    for p, q in zip(pipe.parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("read", list(READS))
@pytest.mark.parametrize("split_size", [3, 4])  # 6 rows: one divides, one does not
def test_a_dict_forward_changes_is_read_as_the_plain_model_reads_it(
    read: str, split_size: int
) -> None:
    torch.manual_seed(0)
    model = ReadAs(READS[read]).double()
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, split_size=split_size
    )
    x = torch.randn(6, 4, dtype=torch.float64)
    s = torch.randn(6, 4, dtype=torch.float64)
    y = torch.randn(6, 2, dtype=torch.float64)
    for shift in SHIFTS:
        given = _batch(x, s, shift)
        keys = sorted(given)
        pipe.zero_grad()
        model.zero_grad()
        out, expected = pipe(given), model(_batch(x, s, shift))
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        _grads_equal(pipe, model)
        assert sorted(given) == keys  # the caller's dict: left as it was
        pipe.zero_grad()
        model.zero_grad()
        loss = pipe.train_step(_batch(x, s, shift), y, nn.functional.mse_loss)
        expected = nn.functional.mse_loss(model(_batch(x, s, shift)), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        _grads_equal(pipe, model)
    assert pipe.split_report().tracer == "torch.fx"


def test_a_key_popped_with_a_default_is_part_of_the_kind_of_call() -> None:
    # The call that leaves "s" out gets a split that pops nothing; the
    # call that holds it as None, one that pops it and reads None.
    model = ReadAs(READS["pop-None"]).double()
    pipe = Pipe(model, split_points=["b"], devices=["cpu"] * 2, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    for batch in [{"x": x, "s": x + 1}, {"x": x}, {"x": x, "s": None}]:
        pipe(batch)
    assert [t.split(": ", 1)[1] for t in pipe.split_report().traces] == [
        "every argument given",
        "batch['s'] missing",
        "batch['s']=None",
    ]
    assert len(fx_split(pipe).lookups) == 1


def test_a_dict_changed_through_a_second_name_refuses_a_test_naming_it() -> None:
    def tests_after(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        other = batch
        other |= batch["more"]  # keys only the call knows
        return batch["x"], batch["s"] if "s" in other else None

    x = torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"forward tests 's' in batch after changing it in place"):
        Pipe(
            ReadAs(tests_after),
            split_points=["b"],
            devices=["cpu"] * 2,
            chunks=2,
            tracer="fx",
            sample=({"x": x, "more": {"t": x}},),
        )


def _pop_then_test(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
    s = batch.pop("s", None)
    return batch["x"], None if "s" in batch else s  # gone


def _setdefault_then_test(batch: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    batch.setdefault("t", None)
    s = batch.get("s") if "t" in batch else batch["x"]  # "t" is there
    return batch["x"], s if "s" in batch else None  # "s" as the call holds it


def _alias_update_then_test(batch: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    other = batch
    other |= {"t": batch["x"]}
    return batch["x"], batch["s"] if "s" in batch else None  # "s" as the call holds it


def _update_then_test_it(batch: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    batch.update(s=batch["x"] * 3)
    return batch["x"], batch["s"] if "s" in batch else None  # set: there


def _update_then_get_other(batch: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    batch.update({"t": 2.0})
    s = batch.get("s")
    if s is None:  # as the call holds it: a proxy is never None
        return batch["x"] * batch["t"], None
    return batch["x"], s


# With a call to answer them (sample=): without one, every key is taken as given.
@pytest.mark.parametrize(
    "read",
    [
        _pop_then_test,
        _setdefault_then_test,
        _setdefault_flag_then_pop,
        _alias_update_then_test,
        _update_then_test_it,
        _update_then_get_other,
    ],
)
def test_a_key_popped_or_set_then_tested_is_answered_as_forward_left_it(read: Any) -> None:
    torch.manual_seed(0)
    model = ReadAs(read).double()
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=2,
                tracer="fx", sample=({"x": x},))  # fmt: skip
    for shift in SHIFTS:
        pipe.zero_grad()
        model.zero_grad()
        out, expected = pipe(_batch(x, x + 1, shift)), model(_batch(x, x + 1, shift))
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        _grads_equal(pipe, model)


class PopsThenReadsLater(nn.Module):
    """Pops ``s`` (or sets it by default) in its first stage, and reads the
    dict again in its second: the change shows there, as in the module."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, batch: dict[str, Tensor | None]) -> Tensor:
        x = batch["x"]
        assert x is not None
        s = batch.pop("s", None) if self.how == "pop" else batch.setdefault("s", x * 2)
        h = torch.tanh(self.a(x))
        if s is not None:
            h = h * s
        later = batch.get("s", torch.full_like(x, 0.5))
        assert later is not None
        return self.b(h) * later[:, :2]  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["pop", "setdefault"])
@pytest.mark.parametrize("force_copies", [False, True])  # the dict sent to the next stage
def test_a_dict_changed_in_one_stage_is_read_changed_in_the_next(
    how: str, force_copies: bool
) -> None:
    torch.manual_seed(0)
    model = PopsThenReadsLater(how).double()
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, split_size=4,
                force_copies=force_copies)  # fmt: skip
    x = torch.randn(6, 4, dtype=torch.float64)
    s = torch.randn(6, 4, dtype=torch.float64)
    shifts = ["given", "left out", "given"] + (["None", "left out"] if how == "pop" else [])
    for shift in shifts:
        pipe.zero_grad()
        model.zero_grad()
        out, expected = pipe(_batch(x, s, shift)), model(_batch(x, s, shift))
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        _grads_equal(pipe, model)

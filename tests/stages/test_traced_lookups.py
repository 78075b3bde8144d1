"""A key a call leaves out of a dict, which ``forward`` looks up
(``batch.get("s")``, ``batch.get("s", default)``, ``"s" in batch``),
makes a kind of call of its own for torch.fx: the trace answers the lookup
as the module does, so the right split runs. Outputs and gradients equal
the plain module's for every kind, in any order."""

from __future__ import annotations

import copy
import enum
import pickle
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.stages import traced as traced_module
from mpstream.stages.fx import trace
from mpstream.stages.lookups import Lookup, missing_keys
from tests.stages.test_traced import fx_split
from tests.stages.test_traced_items import ReadAs

READS = {
    "get": lambda b: (b["x"], b.get("s")),
    "get-None": lambda b: (b["x"], b.get("s", None)),
    "get-default": lambda b: (b["x"], b.get("s", 0.5)),
    "get-traced-default": lambda b: (b["x"], b.get("s", b["x"] * 2)),
    "nested": lambda b: (b["x"], b["extra"].get("s")),
    # A test needs a call to answer it: sample= gives the first.
    "in": lambda b: (b["x"], b["s"] if "s" in b else None),
    "not-in": lambda b: (b["x"], None if "s" not in b else b["s"]),
}


def _batch(read: str, x: Tensor, s: Tensor | None) -> dict[str, Any]:
    given = {} if s is None else {"s": s}
    return {"x": x, "extra": given} if read == "nested" else {"x": x, **given}


@pytest.mark.parametrize("read", list(READS))
@pytest.mark.parametrize("split_size", [2, 4])
@pytest.mark.parametrize("first", ["given", "left out"])
def test_a_key_left_out_is_looked_up_as_the_plain_model_does(
    read: str, split_size: int, first: str
) -> None:
    torch.manual_seed(0)
    model = ReadAs(READS[read]).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    s = torch.randn(6, 4, dtype=torch.float64)
    shifts = [s, None, s, None] if first == "given" else [None, s, None, s]
    sample = (_batch(read, x, shifts[0]),) if "in" in read else None
    pipe = Pipe(
        copy.deepcopy(model),
        split_points=["b"],
        devices=["cpu"] * 2,
        split_size=split_size,
        sample=sample,
    )
    for shift in shifts:
        batch = _batch(read, x, shift)
        pipe.zero_grad()
        model.zero_grad()
        out, expected = pipe(batch), model(batch)
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        for p, q in zip(pipe.parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    split = fx_split(pipe)
    assert len(split.traces) == 2  # each kind traced once, then reused
    owner = "batch['extra']" if read == "nested" else "batch"
    kinds = ["every argument given", f"{owner}['s'] missing"]
    if sample is not None and first == "left out":
        kinds.reverse()
    assert [t.split(": ", 1)[1] for t in pipe.split_report().traces] == kinds


def test_a_key_left_out_and_a_none_item_share_the_split_of_get() -> None:
    torch.manual_seed(0)
    model = ReadAs(READS["get"]).double()
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    for batch in [{"x": x, "s": None}, {"x": x}, {"x": x, "s": x}, {"x": x}]:
        torch.testing.assert_close(pipe(batch), model(batch))
    split = fx_split(pipe)
    assert len(split.traces) == 2 and len(split.kinds) == 3
    assert [t.described for t in split.traces] == [
        "training: every argument given",
        "training: batch['s']=None",
    ]


def _get(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
    return batch["x"], batch.get("s")  # by name: a lambda does not pickle


def test_a_pickled_pipe_keeps_the_keys_its_traces_looked_up() -> None:
    torch.manual_seed(0)
    model = ReadAs(_get).double()
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    batches = [{"x": x, "s": x}, {"x": x}]
    for batch in batches:
        pipe(batch)
    pipe = pickle.loads(pickle.dumps(pipe))
    for batch in batches:
        torch.testing.assert_close(pipe(batch), model(batch))
    assert len(fx_split(pipe).traces) == 2  # no kind traced again


def _local_key() -> enum.Enum:
    class Key(enum.Enum):  # defined in a function: it does not pickle
        S = "s"

    return Key.S


LOCAL_KEY = _local_key()


def _tests_local(batch: dict[Any, Tensor]) -> tuple[Tensor, Tensor | None]:
    # The split's code holds no key (fx could not pickle it): only the lookups.
    return batch["x"], batch["x"] + 1 if LOCAL_KEY in batch else None


@pytest.mark.parametrize("split_size", [2, 4])  # 6 rows
def test_a_pipe_that_looked_up_a_key_that_does_not_pickle_pickles_and_traces_again(
    split_size: int,
) -> None:
    # Its kinds went with the key: a call leaving the key out must not take
    # the split of one that gives it, nor the other way round.
    torch.manual_seed(0)
    model = ReadAs(_tests_local).double()
    x, s = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    y = torch.randn(6, 2, dtype=torch.float64)
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2,
                split_size=split_size, sample=({"x": x, LOCAL_KEY: s},))  # fmt: skip
    pipe({"x": x})
    pipe = pickle.loads(pickle.dumps(pipe))
    for batch in [{"x": x}, {"x": x, LOCAL_KEY: s}, {"x": x}]:
        pipe.zero_grad()
        model.zero_grad()
        out, expected = pipe(batch), model(batch)
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        for p, q in zip(pipe.parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        pipe.zero_grad()
        model.zero_grad()
        loss = pipe.train_step(batch, y, nn.functional.mse_loss)
        expected = nn.functional.mse_loss(model(batch), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        for p, q in zip(pipe.parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    assert len(fx_split(pipe).traces) == 2  # each kind traced again, its split shared


def test_a_pipe_that_looks_no_key_up_keeps_no_lookups() -> None:
    """A call of such a pipe never looks at its dicts' keys (see FxSplit._key)."""
    model = ReadAs(lambda b: (b["x"], b["s"])).double()
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    for batch in [{"x": x, "s": x}, {"x": x, "s": None, "t": x}]:
        torch.testing.assert_close(pipe(batch), model(batch))
    assert fx_split(pipe).lookups == set()


@pytest.mark.parametrize("balance", [None, "time"])
def test_a_sample_that_leaves_a_key_out_traces_that_kind_first(balance: str | None) -> None:
    torch.manual_seed(0)
    model = ReadAs(READS["get"]).double()
    x = torch.randn(4, 4, dtype=torch.float64)
    batch = {"x": x}
    placed: dict[str, Any] = {"split_points": ["b"]} if balance is None else {"balance": balance}
    pipe = Pipe(copy.deepcopy(model), devices=["cpu"] * 2, chunks=2, sample=(batch,), **placed)
    torch.testing.assert_close(pipe(batch), model(batch))
    assert [t.described for t in fx_split(pipe).traces] == ["training: batch['s'] missing"]
    batch = {"x": x, "s": x}
    torch.testing.assert_close(pipe(batch), model(batch))
    assert len(fx_split(pipe).traces) == 2


class ReadsTWithoutS(nn.Module):
    """Looks ``t`` up only in a call that leaves ``s`` out."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        h = torch.tanh(self.a(batch["x"]))
        s = batch.get("s")
        if s is None:
            s = batch.get("t")
        if s is not None:
            h = h + s
        return self.b(h)  # type: ignore[no-any-return]


def test_a_kind_is_not_traced_again_for_a_key_its_trace_never_looked_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The trace with "s" given never looks "t" up: a later trace that does
    # (with "s" left out) leaves that kind's split serving it, t or no t.
    traces = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        traces.append(kwargs.get("values"))
        return trace(*args, **kwargs)

    monkeypatch.setattr(traced_module, "trace", counted)
    torch.manual_seed(0)
    model = ReadsTWithoutS().double()
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    batches = [{"x": x, "s": x}, {"x": x}, {"x": x, "s": x}, {"x": x, "t": x}]
    batches += [{"x": x, "s": x, "t": x}, {"x": x}, {"x": x, "t": x}]
    for batch in batches:
        torch.testing.assert_close(pipe(batch), model(batch))
    # At construction (every key given), then {"x"} and {"x", "t"} only.
    assert [None if v is None else sorted(v["batch"]) for v in traces] == [
        None,
        ["x"],
        ["t", "x"],
    ]


class FillsS(nn.Module):
    """Fills in ``s`` itself (``how``), then looks it up."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, batch: dict[str, Tensor | None]) -> Tensor:
        x = batch["x"]
        assert x is not None
        if self.how == "setdefault":
            batch.setdefault("s", x * 0 + 1)
        else:
            batch.update(s=x * 0 + 1)
        h = torch.tanh(self.a(x))
        s = batch.get("s") if self.how != "update-in" else batch["s"] if "s" in batch else None
        if s is not None:
            h = h + s
        return self.b(h)  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["setdefault", "update"])
def test_a_key_looked_up_after_forward_changed_the_dict_is_not_answered_from_the_call(
    how: str,
) -> None:
    # The call's "s" (left out, or None) is no answer once forward filled it
    # in. (setdefault keeps a None "s", and the dict as it is.)
    torch.manual_seed(0)
    model = FillsS(how).double()
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, split_size=3)
    x = torch.randn(4, 4, dtype=torch.float64)
    batches = [lambda: {"x": x, "s": x}, lambda: {"x": x}, lambda: {"x": x, "s": None}]
    for batch in batches:
        torch.testing.assert_close(pipe(batch()), model(batch()))


def test_a_key_tested_after_forward_set_it_by_update_is_answered_as_set() -> None:
    torch.manual_seed(0)
    model = FillsS("update-in").double()
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2, split_size=3,
                tracer="fx", sample=({"x": x},))  # fmt: skip
    for batch in [lambda: {"x": x, "s": x}, lambda: {"x": x}, lambda: {"x": x, "s": None}]:
        pipe.zero_grad()
        model.zero_grad()
        out, expected = pipe(batch()), model(batch())
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        for p, q in zip(pipe.parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    assert pipe.split_report().tracer == "torch.fx"


def test_a_key_tested_after_an_update_by_a_traced_dict_is_refused_naming_it() -> None:
    def tests_after(batch: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
        batch.update(batch["more"])  # keys only the call knows
        return batch["x"], batch["s"] if "s" in batch else None

    x = torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"forward tests 's' in batch after changing it in place"):
        Pipe(ReadAs(tests_after), split_points=["b"], devices=["cpu"] * 2, chunks=2,
             tracer="fx", sample=({"x": x, "more": {"t": x}},))  # fmt: skip


class Tagged(nn.Module):
    """Tests a key in a string argument, which is no dict."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: Tensor, tag: str) -> Tensor:
        h = self.a(x)
        if "double" in tag:
            h = h * 2
        return self.b(h)  # type: ignore[no-any-return]


def test_a_key_tested_without_a_call_to_answer_it_is_refused_naming_it() -> None:
    model = ReadAs(READS["in"])
    with pytest.raises(
        TypeError, match=r"forward tests 's' in batch, .* pass Pipe\(\.\.\., sample="
    ):
        Pipe(model, split_points=["b"], devices=["cpu"] * 2, chunks=2, tracer="fx")
    # torch.export splits it instead, as it did before torch.fx answered tests.
    pipe = Pipe(model, split_points=["b"], devices=["cpu"] * 2, chunks=2)
    assert pipe.split_report().tracer == "torch.export"


def test_a_key_tested_in_what_is_no_dict_is_refused_naming_it() -> None:
    sample = (torch.randn(4, 4), "single")
    with pytest.raises(TypeError, match=r"forward tests 'double' in tag, which the call holds"):
        Pipe(
            Tagged(), split_points=["b"], devices=["cpu"] * 2, chunks=2, tracer="fx", sample=sample
        )
    pipe = Pipe(Tagged(), split_points=["b"], devices=["cpu"] * 2, chunks=2, sample=sample)
    assert pipe.split_report().tracer == "torch.export"


class Tags(nn.Module):
    """Tests a key in ``tags``: a dict in one call, a list in another."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: Tensor, tags: Any) -> Tensor:
        h = self.a(x)
        if "s" in tags:
            h = h * 2
        return self.b(h)  # type: ignore[no-any-return]


def test_a_key_tested_in_a_list_is_no_key_left_out_of_a_dict() -> None:
    # Both leave the test unanswered by a dict: the list's call must not
    # reuse the split traced with "s" not in the dict (which skips h * 2).
    model = Tags().double()
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe = Pipe(
        copy.deepcopy(model),
        split_points=["b"],
        devices=["cpu"] * 2,
        chunks=2,
        tracer="fx",
        sample=(x, {}),
    )
    torch.testing.assert_close(pipe(x, {}), model(x, {}))
    with pytest.raises(TypeError, match=r"forward tests 's' in tags, which the call holds as no"):
        pipe(x, ["s"])
    torch.testing.assert_close(pipe(x, {"s": 1}), model(x, {"s": 1}))


def test_missing_keys_names_what_a_call_leaves_out() -> None:
    x = torch.zeros(1)
    lookups = [
        Lookup(("batch", ()), "s", test=False),
        Lookup(("batch", (("[", "extra"),)), "t", test=False),
        Lookup(("batch", (("[", "gone"),)), "u", test=False),  # no such item: no dict there
        Lookup(("pair", (("[", 1),)), "v", test=True),  # a list's item
        Lookup(("x", ()), "w", test=False),  # a tensor's .get: the stage calls it
        Lookup(("x", ()), "w", test=True),  # `in` on a tensor: refused when traced
    ]
    values = {"batch": {"x": x, "extra": {}}, "pair": [x, {"v": x}], "x": x}
    assert missing_keys(values, lookups) == {
        "batch['s']",
        "batch['extra']['t']",
        "x['w'] (no mapping)",  # not a key left out of a dict, which a split answers
    }
    given = {"batch": {"s": x, "extra": {"t": x}}, "pair": [x, {"v": x}], "x": {"w": x}}
    assert missing_keys(given, lookups) == set()

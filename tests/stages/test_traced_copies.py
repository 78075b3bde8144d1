"""``copy.deepcopy`` of a torch.fx pipe keeps every kind of call it traced,
a key that does not pickle (an enum defined in a function) and the kinds it
tells apart too (``FxSplit.__deepcopy__``): the copy traces no kind again,
computes what the plain module does, and shares no tensor with the
original. Pickling still leaves such a key out (see
test_traced_lookups.py). A deep copy or a pickle keeps every kind traced; a
pipe pickled before kinds existed loads with its trace as the first."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch
from torch import Tensor

from mpstream import Pipe
from mpstream.stages import traced as traced_module
from mpstream.stages.fx import trace
from tests.helpers import assert_same_grads
from tests.stages.test_traced import Masked, fx_split, pipe_of
from tests.stages.test_traced_items import ReadAs
from tests.stages.test_traced_lookups import LOCAL_KEY, _tests_local


def _tensors(pipe: Pipe) -> list[Tensor]:
    """The pipe's parameters and buffers, and those its splits' stages hold."""
    found = [*pipe.parameters(), *pipe.buffers()]
    for split in fx_split(pipe).traces:
        for part in split.partitions:
            found += [*part.parameters(), *part.buffers()]
            found += [v for v in vars(part).values() if isinstance(v, Tensor)]
    return found


@pytest.mark.parametrize("split_size", [2, 3])  # 8 rows
def test_a_copied_pipe_keeps_the_kinds_a_key_that_does_not_pickle_tells_apart(
    split_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The copy went through pickling's state, which leaves the key out with
    # its kinds: the copy traced each kind again at its first call.
    traces: list[Any] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        traces.append(kwargs.get("values"))
        return trace(*args, **kwargs)

    monkeypatch.setattr(traced_module, "trace", counted)
    torch.manual_seed(0)
    model = ReadAs(_tests_local).double()
    x, s = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    batches = [{"x": x}, {"x": x, LOCAL_KEY: s}, {"x": x}]
    pipe = Pipe(copy.deepcopy(model), split_points=["b"], devices=["cpu"] * 2,
                split_size=split_size, sample=({"x": x, LOCAL_KEY: s},))  # fmt: skip
    for batch in batches:
        pipe(batch)
    assert len(traces) == 2  # one per kind
    copied = copy.deepcopy(pipe)
    assert len(fx_split(copied).kinds) == 2 and fx_split(copied).lookups == fx_split(pipe).lookups
    for batch in batches:
        copied.zero_grad()
        model.zero_grad()
        out, expected = copied(batch), model(batch)
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        assert_same_grads(copied, model)
    assert len(traces) == 2  # the copy traced no kind again
    assert all(p.grad is None for p in pipe.parameters())  # the original's: untouched
    mine = {t.data_ptr() for t in _tensors(pipe)}
    assert not any(t.data_ptr() in mine for t in _tensors(copied))


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


def test_a_pipe_pickled_before_kinds_loads_with_its_trace_as_the_first() -> None:
    model = Masked().double()
    pipe = pipe_of(model, chunks=2, leaf_modules=["proj"])
    state = copy.deepcopy(pipe.__getstate__())
    # What such a pickle held: the one trace's binder, no split per kind.
    state["_bind"] = state["_split"].current.traced.bind
    state["_split"] = None
    old = Pipe.__new__(Pipe)
    old.__setstate__(state)
    split = fx_split(old)
    assert split.leaf_modules == ["a", "b", "proj"]  # what the trace called whole
    x = torch.randn(4, 4, dtype=torch.float64)
    s = torch.randn(4, 4, dtype=torch.float64)
    for args in [(x, s), (x,)]:
        torch.testing.assert_close(old(*args), model(*args))
    assert len(split.traces) == 2

"""The private torch calls mpstream makes (``mpstream.runtime.private``):
each exists in the installed torch and takes what mpstream gives it, so a
torch that changes one fails here rather than deep inside a capture."""

from __future__ import annotations

import re

import pytest
import torch
from torch.autograd.graph import get_gradient_edge

from mpstream.runtime import private
from mpstream.runtime.private import USED, Private, PrivateApiError

CUDA_BUILD = torch.version.cuda is not None


def _arity(doc: str) -> int | None:
    """Top-level arguments of a pybind signature line ``name(a: T, b: U) -> R``
    (None: no signature documented)."""
    match = re.match(r"\w+\((.*)\) ->", doc.strip().splitlines()[0] if doc.strip() else "")
    if match is None:
        return None
    depth, commas, text = 0, 0, match.group(1)
    for ch in text:  # commas outside brackets part arguments: tuple[int, int] is one
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            commas += 1
    return commas + 1 if text.strip() else 0


@pytest.mark.parametrize("p", USED, ids=lambda p: p.name)
def test_every_private_call_exists_with_the_arguments_mpstream_gives(p: Private) -> None:
    if p.cuda_only and not CUDA_BUILD:
        pytest.skip("a CUDA build's call; this torch has none")
    fn = private.lookup(p)
    assert fn is not None, f"torch {torch.__version__} lacks {p.module}.{p.name}"
    documented = _arity(fn.__doc__ or "")
    if documented is not None and p.arity is not None:
        assert documented == p.arity, f"{p.name} now takes {documented} arguments: {fn.__doc__}"
    assert p not in private.missing()


def test_the_calls_behave_as_mpstream_reads_them() -> None:
    assert private.profiler_enabled() is False
    with torch.autograd.profiler.profile():
        assert private.profiler_enabled() is True
    assert private.current_graph_task_id() == -1  # outside a backward pass
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    with pytest.raises(RuntimeError):  # asked outside a backward pass
        private.will_engine_execute_node(get_gradient_edge(y).node)
    seen: list[tuple[bool, int]] = []

    def hook(grad: torch.Tensor) -> None:
        node = get_gradient_edge(y).node
        seen.append((private.will_engine_execute_node(node), private.current_graph_task_id()))

    y.register_hook(hook)
    y.sum().backward()
    assert seen[0][0] is True and seen[0][1] >= 0
    device, dtype, non_blocking, fmt = private.parse_to("cpu", torch.float64, non_blocking=True)
    assert (device, dtype, non_blocking) == (torch.device("cpu"), torch.float64, True)
    assert fmt is None


def test_a_missing_call_names_itself_and_what_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch._C._autograd, "_profiler_enabled")
    assert [p.name for p in private.missing()] == ["_profiler_enabled"]
    with pytest.raises(PrivateApiError, match=r"has no torch\._C\._autograd\._profiler_enabled"):
        private.profiler_enabled()


def test_the_backward_pass_id_is_looked_up_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Asked in every replayed backward task of the user's loop: the call is
    # found when mpstream loads, not looked up again (attributes by name) per task.
    asked: list[str] = []
    real = private.lookup

    def counted(p: private.Private) -> object:
        asked.append(p.name)
        return real(p)

    monkeypatch.setattr(private, "lookup", counted)
    assert private.current_graph_task_id() == -1
    assert asked == []

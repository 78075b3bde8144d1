"""In-place operations across a split: what a pipeline cannot reproduce.

In the module, an in-place operation changes a tensor every later reader
sees. Split into stages, a value another stage made reaches each reader as
passed along (a copy, or the cut at a stage's input), so a change one stage
makes in place is invisible to the stages after it. :func:`check_in_place`
refuses a traced module where that would change the result, at
construction, instead of computing something else silently. A stage that
changes in place a value only it reads (``ReLU(inplace=True)`` opening a
stage) is fine.
"""

from __future__ import annotations

import operator

from torch import fx

__all__ = ["check_in_place"]

_IN_PLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.imatmul,
}  # fmt: skip


def _changed_in_place(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The value ``node`` changes in place (its first argument), if it does."""
    target = node.target
    if node.op == "call_module":
        in_place = getattr(gm.get_submodule(str(target)), "inplace", False) is True
    elif node.op == "call_method":
        in_place = str(target).endswith("_") and not str(target).startswith("_")
    elif node.op == "call_function":
        name = getattr(target, "__name__", "")
        in_place = (
            target in _IN_PLACE_OPERATORS
            or node.kwargs.get("inplace") is True
            or (name.endswith("_") and not name.startswith("_"))
        )
    else:
        return None
    first = node.args[0] if node.args else None
    return first if in_place and isinstance(first, fx.Node) else None


def check_in_place(gm: fx.GraphModule, stage_of: dict[fx.Node, int]) -> None:
    """Refuses an in-place change of another stage's value that a later stage,
    or the result, also reads: stages pass values, they do not share them, so
    that reader would see the value unchanged where the module sees it changed.

    Raises:
        ValueError: naming the operation, the stages and what to do.
    """
    for node in gm.graph.nodes:
        value = _changed_in_place(gm, node)
        if value is None:
            continue
        here = stage_of[node]
        if stage_of.get(value, -1) == here:
            continue  # changed where it is made: later readers get it changed
        later = sorted({t for u in value.users if u.op != "output" and (t := stage_of[u]) > here})
        reader = f"stage {later[0]}" if later else "the result"
        if later or any(u.op == "output" for u in value.users):
            raise ValueError(
                f"'{node.target}' in stage {here} changes '{value.name}' in place, which "
                f"{reader} also reads: stages pass values instead of sharing them, so "
                f"{reader} would read it unchanged. Make that operation out of place "
                f"(inplace=False), or move a split point so both sit in one stage"
            )

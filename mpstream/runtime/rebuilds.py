"""Whether a structure rebuilt from its own leaves hands them back unchanged.

mpstream splits, passes on and joins values as leaves and a pytree
structure, and rebuilds them with pytree's unflatten, which for a class
registered with pytree (a dataclass, ``register_pytree_node``) runs its
constructor again. :func:`check_rebuilds` refuses a class whose constructor
changes the fields it is given, before the pipeline computes with values the
plain model never saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils import _pytree as pytree

__all__ = ["check_rebuilds"]


def check_rebuilds(value: Any, what: str, items: Sequence[Any], spec: Any) -> None:
    """Refuses ``value`` when rebuilding it from its own leaves changes them.

    mpstream rebuilds a structure from leaves (per micro-batch, between
    stages, once joined) through pytree's unflatten, which for a registered
    class (a dataclass, ``register_pytree_node``) calls its constructor: a
    ``__post_init__`` that transforms a field would transform it again, and
    the pipeline would compute with values the plain model never saw. Only
    structures holding such a class pay for the check: builtin containers,
    namedtuples and structseqs rebuild their leaves as given.

    Args:
        value: the structure, as the user's code built it.
        what: how the error names it (``"input"``, ``"stage 0's output"``).
        items: its leaves, and
        spec: its structure, as :func:`~mpstream.runtime.microbatch.leaves`
            gives them.

    Raises:
        TypeError: naming the class, the field it changed, and what to do.
    """
    if type(spec) is not pytree.TreeSpec or not _own_nodes(spec):
        return
    # Rebuild once and compare leaf identity, rather than rebuilding without
    # the constructor: pytree's unflatten of a class registered with its own
    # function is all mpstream knows of how to build it, and a constructor
    # that only validates hands the very leaves it was given back.
    again = pytree.tree_leaves(pytree.tree_unflatten(list(items), spec))
    changed = next((i for i, (a, b) in enumerate(zip(items, again)) if a is not b), None)
    if changed is None and len(again) == len(items):
        return
    i = min(len(again), len(items) - 1) if changed is None else changed
    field, owner = _leaf_owner(value, i, spec)
    raise TypeError(
        f"{what}{field} is held by a {owner} whose constructor (its __post_init__, or the "
        f"unflatten registered with torch.utils._pytree) changes that field when the value "
        f"is rebuilt from its leaves, as mpstream does for every micro-batch: the pipeline "
        f"would compute with values the plain model never saw. Leave the fields the "
        f"constructor is given as they are (validate only), register an unflatten that "
        f"does not transform them, or pass the tensors themselves (a tuple, dict or "
        f"namedtuple)"
    )


def _own_nodes(spec: pytree.TreeSpec) -> list[type[Any]]:
    """The node types of ``spec`` pytree's unflatten builds by calling them
    (not builtin containers, namedtuples or structseqs), outermost first."""
    found: list[type[Any]] = []
    stack = [spec]
    while stack:
        node = stack.pop()
        if node.is_leaf():
            continue
        kind = node.type
        if kind not in pytree.BUILTIN_TYPES and not pytree.is_structseq_class(kind):
            found.append(kind)
        stack.extend(reversed(node.children()))
    return found


def _leaf_owner(value: Any, i: int, spec: pytree.TreeSpec) -> tuple[str, str]:
    """Leaf ``i`` of ``value`` by its path (``[0].x``), and the innermost
    class holding it that unflatten builds by calling it."""
    try:
        path = pytree.tree_flatten_with_path(value)[0][i][0]
    except ValueError:  # a class registered without keys names no fields
        return f" leaf {i}", _own_nodes(spec)[0].__qualname__
    owner, node = None, value
    for key in path:
        if not (
            type(node) in pytree.BUILTIN_TYPES
            or pytree.is_namedtuple_instance(node)
            or pytree.is_structseq_instance(node)
        ):
            owner = type(node)
        node = key.get(node)
    kind = owner if owner is not None else _own_nodes(spec)[0]
    return pytree.keystr(path), kind.__qualname__

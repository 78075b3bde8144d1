"""Where in the last stage's output a gather error is: paths the user reaches.

:func:`output_name` names one leaf of a micro-batch's output as the user
indexes it (``output[1]``, ``output["aux_loss"]``); :func:`structure_difference`
says where two micro-batches' outputs stop having the same structure (the
containers, their keys and lengths), and what each had there, so the gather
(:func:`~mpstream.runtime.gathering.gather`) can name the spot.
"""

from __future__ import annotations

import reprlib
from typing import Any

from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["output_name", "structure_difference"]


def output_name(out: Any, i: int) -> str:
    """Leaf ``i`` of ``out`` (a micro-batch's output) as the user reaches it:
    ``the output``, ``output[1]``, ``output["aux_loss"]``, ``output.aux``."""
    if type(out) is Tensor:
        return "the output"
    try:
        paths = pytree.tree_flatten_with_path(out)[0]
    except (ValueError, TypeError, NotImplementedError):
        # A node type registered without key paths: its position is all there is.
        return f"output leaf {i} (of {len(pytree.tree_leaves(out))})"
    return _named(paths[i][0])


def structure_difference(first: Any, other: Any, micro_batch: int) -> str | None:
    """Where ``other`` (micro-batch ``micro_batch``'s output) is structured
    unlike ``first`` (micro-batch 0's), and what each holds there, e.g.
    ``output[1] is None for micro-batch 0 and a tuple of 2 items for
    micro-batch 1``; None where their structures agree (their leaves may
    still differ: a tensor in one, a plain value in the other)."""
    if pytree.tree_structure(first) == pytree.tree_structure(other):
        return None
    try:
        paths = [path for v in (first, other) for path, _ in pytree.tree_flatten_with_path(v)[0]]
    except (ValueError, TypeError, NotImplementedError):
        paths = []  # no key paths to follow: the outputs as wholes
    # Following each leaf's path from the top, the structures part where
    # the two first differ in kind, keys or length, or either cannot go on.
    for path in paths:
        here, a, b = _parting(first, other, path)
        if len(here) < len(path):
            break
    else:
        here, a, b = (), first, other
    return (
        f"{_named(here)} is {_what(a)} for micro-batch 0 and {_what(b)} for "
        f"micro-batch {micro_batch}"
    )


def _parting(a: Any, b: Any, path: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any, Any]:
    """How far along ``path`` ``a`` and ``b`` go alike, and what each holds there."""
    for depth, key in enumerate(path):
        if not _alike(a, b):
            return path[:depth], a, b
        try:
            a, b = key.get(a), key.get(b)
        except (KeyError, IndexError, AttributeError, TypeError):
            return path[:depth], a, b
    return path, a, b


def _alike(a: Any, b: Any) -> bool:
    """Whether two containers agree in kind, keys and length."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b)
    return True


def _named(path: tuple[Any, ...]) -> str:
    return "output" + pytree.keystr(path) if path else "the output"


def _what(value: Any) -> str:
    """``value`` as far as its structure goes: a tensor's shape, a
    container's keys or length, a plain value itself."""
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if value is None:
        return "None"
    if isinstance(value, dict):
        return f"a dict with keys {list(value)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} item{'' if len(value) == 1 else 's'}"
    return f"{type(value).__name__} {reprlib.repr(value)}"

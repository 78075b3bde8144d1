"""In-place operations in a traced module: which value each one changes.

In the module, an in-place operation changes a tensor every later reader
sees. :func:`changes_in_place` finds each one in a traced graph and the
value it changes (an aten operation's written argument, a method or
function ending in ``_``, ``inplace=True``, an augmented assignment, a dict
update); :mod:`~mpstream.stages.inplace_check` refuses those a split cannot
reproduce. :func:`augmented` is what a ``torch.fx`` trace records for
``h += y``, which changes ``h`` in place too (an input's too:
:func:`copy_changed_inputs` gives it a copy first, :func:`own`); ``n += 1``
on a number read off a tensor's size makes a new number instead.
"""

from __future__ import annotations

import functools
import operator
from copy import copy as shallow_copy
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from .field_writes import replaced
from .inplace_paths import base as _base
from .inplace_paths import path as _path
from .inplace_paths import updated
from .inplace_paths import updates as _updates

__all__ = ["copy_changed_inputs", "changes_in_place", "augmented", "own"]

_IN_PLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.imatmul,
    operator.setitem,
}  # fmt: skip
_IN_PLACE_DUNDERS = {f"__{op.__name__}__" for op in _IN_PLACE_OPERATORS}


def augmented(target: Any, value: Any, op: str) -> Any:
    """``target op= value`` (``op`` an in-place operator's name, ``"iadd"``):
    what a ``torch.fx`` trace of ``h += y`` calls (see
    :class:`~mpstream.stages.proxies.AugmentedProxy`)."""
    if isinstance(target, fx.Proxy):
        # A stage's code traced again (a pickled pipe loaded): stay a call,
        # as fx's own proxy would make it ``h = h + y``.
        return target.tracer.create_proxy("call_function", augmented, (target, value, op), {})
    return getattr(operator, op)(target, value)


# What a traced forward reads off a tensor that is no tensor: a number, a
# size, a dtype (immutable, so ``n += 1`` on it makes a new value).
_PLAIN_METHODS = {
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "stride", "item",
    "storage_offset", "get_device", "is_contiguous", "is_floating_point", "is_complex",
}  # fmt: skip
_PLAIN_ATTRIBUTES = {"shape", "ndim", "dtype", "device", "is_cuda", "requires_grad", "layout"}
_ARITHMETIC = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
    operator.mod, operator.pow, operator.neg, operator.pos, operator.abs,
}  # fmt: skip


def _changed_in_place(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The value ``node`` changes in place (its first argument), if it does."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):  # an exported aten operation
        written = [a for a in target._schema.arguments if a.alias_info and a.alias_info.is_write]
        changed = _argument(node, target, written[0].name) if written else None
        return changed if isinstance(changed, fx.Node) else None
    if node.op == "call_module":
        in_place = getattr(gm.get_submodule(str(target)), "inplace", False) is True
    elif node.op == "call_method":
        # A method called on a plain tensor with a traced argument
        # (``self.buf[0] = h``, a buffer fx reads as a tensor) is recorded
        # by its own name: ``__setitem__``, ``__iadd__``.
        name = str(target)
        in_place = (name.endswith("_") and not name.startswith("_")) or name in _IN_PLACE_DUNDERS
    elif node.op == "call_function" and (target is updated or target is replaced):
        # A dict's keys set, or a namedtuple's fields: the structure changes, no tensor.
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    elif node.op == "call_function":
        name = getattr(target, "__name__", "")
        in_place = (
            target in _IN_PLACE_OPERATORS
            or target is augmented
            or node.kwargs.get("inplace") is True
            or (name.endswith("_") and not name.startswith("_"))
        )
        if (target is augmented or target in _IN_PLACE_OPERATORS) and _plain(node.args[0]):
            return None  # ``n += 1`` on a size rebinds ``n``: nothing else sees it
    else:
        return None
    out = node.kwargs.get("out")
    if isinstance(out, fx.Node):  # torch.add(a, b, out=h) writes into h
        return out
    first = node.args[0] if node.args else None
    return first if in_place and isinstance(first, fx.Node) else None


def _plain(value: Any) -> bool:
    """Whether a traced value is surely no tensor: read off a tensor's
    metadata (``x.size(1)``, ``x.shape[0]``), or computed from such values
    and constants alone."""
    if not isinstance(value, fx.Node):
        return isinstance(value, (int, float, bool))
    target = value.target
    if value.op == "call_method":
        return target in _PLAIN_METHODS
    if value.op != "call_function":
        return False  # an input or a module's result may be a tensor
    if target is getattr:
        return value.args[1] in _PLAIN_ATTRIBUTES
    if target is operator.getitem:
        return isinstance(value.args[0], fx.Node) and _plain(value.args[0])
    if target in _ARITHMETIC or target is augmented:
        operands = value.args[:2] if target is augmented else value.args
        return any(isinstance(a, fx.Node) for a in operands) and all(_plain(a) for a in operands)
    return False


def _argument(node: fx.Node, op: torch._ops.OpOverload, name: str) -> Any:
    """The value ``node`` passes as the aten operation's argument ``name``."""
    for i, argument in enumerate(op._schema.arguments):
        if argument.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name)
    return None


def changes_in_place(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Each in-place operation and the value it changes, which its result is
    too (``y = h.mul_(2)``, ``h *= 2``, a ``torch.export`` graph's later
    readers of ``h``: all ``h``)."""
    changes = {}
    for node in gm.graph.nodes:
        if (value := _changed_in_place(gm, node)) is not None:
            changes[node] = value
    return changes


def own(value: Any, paths: tuple[tuple[Any, ...], ...] | None = None) -> Any:
    """``value``, an input, with a copy of each of its tensors (a tensor, a
    dict or tuple of them; a number as it is), or of those at ``paths``
    alone (keys and indices into it, ``(("x",),)`` for ``batch["x"]``; a
    path stops at the tensor it reaches): what :func:`copy_changed_inputs`
    calls. The structures along a path are copied, the caller's unchanged."""
    if isinstance(value, fx.Proxy):
        # A stage's code traced again (a pickled pipe loaded): stay a call.
        args = (value,) if paths is None else (value, paths)
        return value.tracer.create_proxy("call_function", own, args, {})
    if paths is None:
        return pytree.tree_map_only(torch.Tensor, torch.clone, value)
    for path in paths:
        value = _own_at(value, path)
    return value


def _own_at(value: Any, path: tuple[Any, ...]) -> Any:
    """``value`` with a copy of the tensor at ``path`` (of every tensor under
    it where the path ends before a tensor, or leads nowhere known)."""
    if path and not isinstance(value, torch.Tensor):
        key, rest = path[0], path[1:]
        if isinstance(value, dict) and key in value:
            copied = shallow_copy(value)  # a dict of the same type
            copied[key] = _own_at(value[key], rest)
            return copied
        if isinstance(key, str) and key in getattr(value, "_fields", ()):
            key = value._fields.index(key)  # a namedtuple's field, read as batch.x
        if (
            isinstance(value, (list, tuple))
            and isinstance(key, int)
            and -len(value) <= key < len(value)
        ):
            items = list(value)
            items[key] = _own_at(value[key], rest)
            if isinstance(value, list):
                return items
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return pytree.tree_map_only(torch.Tensor, torch.clone, value)


def copy_changed_inputs(
    gm: fx.GraphModule, stage_of: dict[fx.Node, int]
) -> dict[fx.Node, tuple[tuple[Any, ...], ...]]:
    """Gives each input the forward changes in place (``x.div_(255)``,
    ``x[:, 0] = 0``) a copy of its own, made before its first reader, which
    every reader reads instead (``stage_of`` gets the copy's stage).

    A pipeline's micro-batches of one input are views of the batch and
    share its version counter: one micro-batch's change would fail the
    backward of every other that saved its own. The caller's batch is left
    as it was, where the module would have changed it. An input torch.fx
    traces may be a structure (a dict batch) or a number, not a tensor: of
    a structure, only the tensors changed get a copy (``batch["x"]``, not
    ``batch["y"]``). A dict update (``batch |= {"t": h}``) copies no
    tensor: it writes into none, and each micro-batch's dict is the
    pipe's own already (the pipe splits the caller's into new ones).
    The input still passes through ``own`` there, so that a later stage
    reads the dict the changing stage returns, with its keys set.

    Returns:
        Each input with tensors changed (its placeholder) and the paths
        into it copied.
    """
    changed: dict[fx.Node, dict[tuple[Any, ...], None]] = {}  # the paths changed in each
    copied: dict[fx.Node, tuple[tuple[Any, ...], ...]] = {}
    changes = changes_in_place(gm)
    for node, value in changes.items():
        if (base := _base(value, changes)).op == "placeholder":
            found = changed.setdefault(base, {})
            if not _updates(node, changes):
                found[_path(value, changes)] = None
    for holder, found in changed.items():
        # A path under another's copy is copied with it.
        paths = tuple(p for p in found if not any(p[: len(q)] == q for q in found if q != p))
        if paths:
            copied[holder] = paths
        first = next(n for n in gm.graph.nodes if n in holder.users)
        with gm.graph.inserting_before(first):
            # The whole input where it is changed itself (a tensor, or ``batch["x"] = t``).
            args = (holder,) if () in paths else (holder, paths)
            copy = gm.graph.call_function(own, args)
        holder.replace_all_uses_with(copy, delete_user_cb=functools.partial(operator.is_not, copy))
        stage_of[copy] = stage_of[first]
    if changed:
        gm.graph.lint()
        gm.recompile()
    return copied

"""In-place operations across a split: what a pipeline cannot reproduce.

In the module, an in-place operation changes a tensor every later reader
sees. Split into stages, a value another stage made reaches each reader as
passed along (a copy, or the cut at a stage's input), so a change one stage
makes in place is invisible to the stages after it, but for what they read
through the changing stage: a view it takes of the changed value (before or
after the change) or the operation's result (``y = h.mul_(2)``) leaves that
stage changed. :func:`check_in_place` refuses a traced module where that
would change the result, at construction, instead of computing something
else silently. A stage that changes in place a value only it reads
(``ReLU(inplace=True)`` opening a stage) is fine. A view shares its
tensor's memory, so a change through a view (``h[:, 0] = 0``,
``h.view(-1).mul_(2)``) is a change of the tensor and of every other view of
it. The items of a structure (``batch["x"]`` and ``batch["m"]``, a
namedtuple's fields) are memories of their own, where the trace shows it a
structure and not a leaf module's result (see
:mod:`~mpstream.stages.inplace_paths`). :func:`augmented` is
what a ``torch.fx`` trace records for ``h += y``, which changes ``h`` in
place too (an input's too: :func:`copy_changed_inputs` gives it a copy
first); ``n += 1`` on a number read off a tensor's size makes a new number
instead.
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
from .inplace_paths import given as _given
from .inplace_paths import memory as _memory
from .inplace_paths import overlap as _overlap
from .inplace_paths import path as _path
from .inplace_paths import updated
from .inplace_paths import updates as _updates
from .inplace_paths import viewed as _viewed
from .inplace_paths import written as _written
from .lookups import item_name

__all__ = ["check_in_place", "copy_changed_inputs", "changes_in_place", "augmented"]

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


def _entry(
    node: fx.Node, here: int, stage_of: dict[fx.Node, int], changes: dict[fx.Node, fx.Node]
) -> fx.Node:
    """The value ``node`` views (itself if none) that stage ``here`` receives
    from an earlier stage: each value passed in arrives as its own tensor."""
    while stage_of.get(node, -1) == here and (viewed := _viewed(node, changes)) is not None:
        node = viewed
    return node


def _name(node: fx.Node) -> str:
    target = node.target
    if target in (augmented, updated):
        return "update" if target is updated else str(node.args[2])
    return str(getattr(target, "__name__", target))


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


def _carries(
    value: fx.Node,
    t: int,
    here: int,
    entry: fx.Node,
    stage_of: dict[fx.Node, int],
    changes: dict[fx.Node, fx.Node],
) -> bool:
    """Whether stage ``t``, reading ``value`` (a view of the changed tensor,
    or itself), sees the change stage ``here`` makes through ``entry``, the
    value it received: what ``value`` views there is ``entry``, or came from
    a stage that made it so (a view taken in the changing stage, before or
    after the change, leaves that stage changed)."""
    while t > here:
        value = _entry(value, t, stage_of, changes)
        if (made := stage_of.get(value, -1)) >= t:
            return False
        t = made
    return t == here and _entry(value, here, stage_of, changes) is entry


def check_in_place(gm: fx.GraphModule, stage_of: dict[fx.Node, int]) -> None:
    """Refuses an in-place change of another stage's value that a later stage,
    or the result, also reads, or the same stage through another view passed
    from an earlier stage: stages pass values, they do not share them, so
    that reader would see the value unchanged where the module sees it changed.
    A view the changing stage takes of the value it changes (before or after
    the change) carries the change to the stages that read it.

    Raises:
        ValueError: naming the operation, the stages, the value read and what to do.
    """
    changes = changes_in_place(gm)
    # Every value viewing each base, itself first, and the items of it it views.
    views: dict[fx.Node, list[tuple[fx.Node, tuple[Any, ...]]]] = {}
    for node in gm.graph.nodes:
        owner, keys = _memory(node, changes)
        views.setdefault(owner, []).append((node, keys))
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node, value in changes.items():
        here = stage_of[node]
        base, keys = _memory(value, changes)
        if stage_of.get(base, -1) == here:
            continue  # changed where it is made: later readers get it changed
        # What this stage received of it, which the change is made to.
        entry = _entry(value, here, stage_of, changes)
        # A dict update changes the keys it sets alone, where the code writes them.
        written = [(*keys, k) for k in _given(node, changes)] or [keys]
        stale = []
        for view, its in views[base]:
            for u in view.users:
                # Taking an item reads that item alone (``batch["m"]`` of ``batch``).
                read = _memory(u, changes)[1] if _viewed(u, changes) is view else its
                hit = next((w for w in written if _overlap(w, read)), None)
                if hit is None:
                    continue  # another item of the structure: memory of its own
                # The result reads a value as the stage that makes it returns it.
                t = stage_of.get(view, -1) if u.op == "output" else stage_of[u]
                if order[u] > order[node] and not _carries(view, t, here, entry, stage_of, changes):
                    stale.append((u, view, hit))
        if stale:
            reader, view, hit = min(stale, key=lambda r: order[r[0]])
            _refuse(node, here, base, hit, entry, reader, view, stage_of, changes)


def _changed_name(node: fx.Node, keys: tuple[Any, ...], changes: dict[fx.Node, fx.Node]) -> str:
    """What ``node`` changes, named as the code reaches it (``batch[0]['t']``),
    where only items and fields lie between: else the value it views and
    ``keys``, the items of it changed (``batch['x']``, the rest not changed)."""
    found = _written(changes[node], changes)
    if found is None:
        root, steps = _base(node, changes), tuple(("[", k) for k in keys)
    else:
        # A dict update changes the key it sets (``keys`` ends with it).
        root, steps = (
            found[0],
            found[1] + tuple(("[", k) for k in keys[-1:] if _given(node, changes)),
        )
    # An input's copy (copy_changed_inputs) is named for the input.
    name = str(root.args[0] if root.target is own else root)
    return item_name((name, steps)) if steps else f"'{name}'"


def _written_back(node: fx.Node) -> bool:
    """Whether ``node``, a dict's update, is written back into the dict's
    owner (:func:`~mpstream.stages.item_writes.write_back`: ``batch |=
    {"inner": inner}``, or ``batch.inner``'s owner replaced)."""
    return any(u.target in (updated, replaced) and u.args[0] is not node for u in node.users)


def _refuse(
    node: fx.Node,
    here: int,
    base: fx.Node,
    keys: tuple[Any, ...],
    entry: fx.Node,
    reader: fx.Node,
    view: fx.Node,
    stage_of: dict[fx.Node, int],
    changes: dict[fx.Node, fx.Node],
) -> None:
    """Raises the error of :func:`check_in_place` for ``reader``, which reads
    ``view`` (the changed value, or a view of it) without the change."""
    changed = _changed_name(node, keys, changes)
    t = -1 if reader.op == "output" else stage_of[reader]
    who = "the result" if t < 0 else f"stage {t}"
    through = "" if view is base else f" through its view '{view}'"
    if base.op == "get_attr":
        # The module's own tensor (a buffer): no stage passes it on, each
        # reads the one tensor on its own stream while the others run.
        raise ValueError(
            f"'{_name(node)}' in stage {here} changes {changed} in place, a tensor of the "
            f"module's own, which {who} also reads{through}: stages run at once on their own "
            f"streams, so which micro-batch's change {who} sees depends on timing, where the "
            f"module sees this call's. Keep the code that changes it and the code that reads "
            f"it in one stage (move a split point), or give each stage a tensor of its own"
        )
    hint = f", take the view in stage {here} after the change" if through else ""
    if t == here:
        # It reads another copy than the one changed, which came on its own.
        got = _entry(view, here, stage_of, changes)
        through = f" through '{got}', which reaches it apart from '{entry}'"
    name = base.args[0] if base.target is own else base
    # A dict update has no out-of-place form: through the name read later,
    # that name stands for the updated dict (inplace_paths.record_update).
    # A dict in a dict is written back into it (item_writes.write_back):
    # one refused here is held where a trace cannot write it back.
    updated = node.args[0]  # the dict updated, past the updates before
    while isinstance(updated, fx.Node) and updated in changes:
        updated = changes[updated]
    if not _updates(node, changes):
        fix = f"Make that operation out of place (inplace=False){hint}"
    elif updated is base:
        fix = (
            f"Update {name} by its own name ({name} |= {{...}} or {name}[key] = value: the "
            f"name then stands for the updated dict, which {who} reads)"
        )
    elif _written_back(node):
        # So the stale read is of a name taken before the change.
        fix = (
            f"{who[0].upper()}{who[1:]} reads the dict by a name taken before the change, "
            f"which the change, handed on through {name}, misses: read it by a name taken "
            f"after the change"
        )
    else:
        fix = (
            f"The dict is held in {name} where a trace cannot write it back (in a list or "
            f"a field): pass tracer='export'"
        )
    raise ValueError(
        f"'{_name(node)}' in stage {here} changes {changed} in place, which {who} also "
        f"reads{through}: stages pass values instead of sharing them, so {who} would read "
        f"it unchanged. {fix}, or move a split point so both sit in one stage"
    )

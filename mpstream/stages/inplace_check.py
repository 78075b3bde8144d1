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
:mod:`~mpstream.stages.inplace_paths`). Which operations change what:
:mod:`~mpstream.stages.inplace`.
"""

from __future__ import annotations

from typing import Any

from torch import fx

from .field_writes import replaced
from .inplace import augmented, changes_in_place, own
from .inplace_paths import base as _base
from .inplace_paths import given as _given
from .inplace_paths import memory as _memory
from .inplace_paths import overlap as _overlap
from .inplace_paths import updated
from .inplace_paths import updates as _updates
from .inplace_paths import viewed as _viewed
from .inplace_paths import written as _written
from .lookups import item_name

__all__ = ["check_in_place"]


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
        rebinds = _updates(node, changes)
        for view, its in views[base]:
            if rebinds and _taken_before(view, len(keys), node, order, changes):
                # A dict update rebinds keys and changes no item: one taken
                # before it is the object the module reads too (a change of
                # that object is a change of its own, checked as such).
                continue
            for u in view.users:
                if _sets_keys_of(u, view, changes):
                    continue  # its readers read the dict it gives: views of base too
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


def _taken_before(
    view: fx.Node,
    depth: int,
    node: fx.Node,
    order: dict[fx.Node, int],
    changes: dict[fx.Node, fx.Node],
) -> bool:
    """Whether ``view`` is (or views) an item of the dict ``depth`` keys
    deep in its memory, taken from it before ``node``: the ``getitem``
    reaching from that dict to the item comes first."""
    at = view
    while (owner := _viewed(at, changes)) is not None:
        if len(_memory(owner, changes)[1]) == depth:
            return len(_memory(at, changes)[1]) > depth and order[at] < order[node]
        at = owner
    return False


def _sets_keys_of(node: fx.Node, view: fx.Node, changes: dict[fx.Node, fx.Node]) -> bool:
    """Whether ``node`` is a dict update of ``view`` (``batch |= {"inner":
    inner}``, the write-back of a dict held in it) that reads nothing of
    it: it sets keys, and what it keeps is read through its result."""
    if not _updates(node, changes) or node.args[0] is not view:
        return False
    rest: list[fx.Node] = []
    fx.node.map_arg((node.args[1:], node.kwargs), rest.append)
    return view not in rest


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

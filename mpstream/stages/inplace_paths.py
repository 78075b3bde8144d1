"""Which memory a traced value is: the value owning it, and the items of it.

A view (``h[:, :2]``, ``h.view(-1)``) or an in-place operation's result
shares its tensor's memory; :func:`base` follows those to the value that
owns it. A structure (a dict batch, a namedtuple, a tuple an operation
returns) holds its items apart: ``batch["x"]`` and ``batch["m"]`` are two
memories of the one value ``batch``, which :func:`memory` tells apart by
their keys. A traced ``getitem`` may index a tensor as well as a
structure; its key is an item's only where the value is surely a
structure, else it stays a view of the whole (:func:`overlap` then finds
every reader). A leaf module's result stays one memory: fx cannot see
whether its items share one (an output's ``last_hidden_state`` is its
``hidden_states[-1]``). A torch call returning a namedtuple of tensors
(``torch.max(h, 1)``, ``torch.sort``) is a structure whose fields are keyed
by index, so ``m.values`` and ``m[0]`` are one item. A dict update
(``batch |= {"t": h}``, ``batch.update(t=h)``: :func:`updates`) sets keys and writes into no
tensor: what the code reads at a key it set is the value set (``h``).
:mod:`~mpstream.stages.inplace` checks and copies by these.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from .field_writes import replaced

__all__ = [
    "viewed", "base", "path", "written", "memory", "overlap", "structure", "fields", "updates",
    "given", "updated", "record_update", "no_dict_update", "updated_inputs",
]  # fmt: skip

# Methods and torch functions whose result may share its first argument's
# memory (a tuple of views for split and the like, whose items are getitems).
VIEWS = {
    "view", "view_as", "reshape", "reshape_as", "transpose", "swapaxes", "swapdims", "t",
    "permute", "movedim", "moveaxis", "expand", "expand_as", "narrow", "select", "squeeze",
    "unsqueeze", "flatten", "unflatten", "unfold", "diagonal", "as_strided", "split",
    "split_with_sizes", "chunk", "unbind", "tensor_split", "hsplit", "vsplit", "dsplit",
    "detach", "contiguous", "real", "imag", "view_as_real", "view_as_complex", "alias",
}  # fmt: skip
# The steps from a value to an item of it, as lookups.Item takes them.
Steps = tuple[tuple[str, Any], ...]

_VIEW_ATTRIBUTES = {"T", "mT", "H", "mH", "data", "real", "imag"}


def viewed(node: fx.Node, changes: dict[fx.Node, fx.Node]) -> fx.Node | None:
    """The value whose memory ``node``'s result may share, if it is a view,
    an item of a structure or an in-place operation (in ``changes``)."""
    if node in changes:
        return changes[node]
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node):
        return None
    if isinstance(node.target, torch._ops.OpOverload):
        # An aten view's schema marks its input and result as aliases (``Tensor(a)``).
        arguments = node.target._schema.arguments
        returns = node.target._schema.returns
        aliased = bool(arguments and arguments[0].alias_info and returns and returns[0].alias_info)
        return first if aliased and not arguments[0].alias_info.is_write else None  # type: ignore[union-attr]
    name = getattr(node.target, "__name__", str(node.target))
    if node.op == "call_method" or (node.op == "call_function" and name in VIEWS):
        return first if name in VIEWS else None
    if node.op == "call_function" and node.target is operator.getitem:
        if (value := _set_at(node, changes)) is not _UNSET:
            # A key a dict update set: its value there, not the dict's.
            return value if isinstance(value, fx.Node) else None
        return first  # indexing a tensor, or an item of a tuple of views
    if node.op == "call_function" and node.target is getattr and len(node.args) > 1:
        return first if _field(node) or node.args[1] in _VIEW_ATTRIBUTES else None
    return None


def _field(node: fx.Node) -> bool:
    """Whether ``node``, a ``getattr``, reads a structure's item, the item
    itself (a namedtuple's ``batch.x``, a model output's ``out.logits``): no
    attribute a tensor has (``x.grad`` is a tensor of its own), a tensor's
    method (``m.values``: on a tensor, a bound method no operation can change,
    so a structure's field), or any attribute of a value surely a structure
    (a namedtuple's field ``grad``)."""
    name = node.args[1]
    if not isinstance(name, str) or not isinstance(node.args[0], fx.Node):
        return False
    method = not name.startswith("_") and callable(getattr(torch.Tensor, name, None))
    return not hasattr(torch.Tensor, name) or method or structure(node.args[0])


def _return_types() -> dict[Any, tuple[str, ...]]:
    """Each torch function and tensor method that may return a namedtuple of
    tensors (a ``torch.return_types``), and its fields in order."""
    found: dict[Any, tuple[str, ...]] = {}
    for name in dir(torch.return_types):
        kind = getattr(torch.return_types, name)
        if name.endswith("_out") or not pytree.is_structseq_class(kind):
            continue
        fields = tuple(kind.__match_args__)
        owners = [(torch, name), (torch.Tensor, name)]
        if name.startswith("linalg_"):  # torch.linalg.svd's, not torch.svd's (Vh, not V)
            owners = [(torch.linalg, name.removeprefix("linalg_"))]
        for owner, attribute in owners:
            if (call := getattr(owner, attribute, None)) is not None:
                found[call] = fields
        found[name] = fields  # a method call (``h.max(1)``), by name
    return found


_RETURN_TYPES = _return_types()
# Calls returning a namedtuple only where a dim is given (``torch.max(h)`` and
# ``torch.max(h, other)`` are tensors).
_BY_DIM = {"max", "min", "median", "nanmedian"}


def fields(value: fx.Node) -> tuple[str, ...]:
    """The fields of the namedtuple of tensors ``value``'s torch call surely
    returns (``torch.max(h, 1)``: ``("values", "indices")``), or ``()``."""
    if value.op == "call_method":
        found = _RETURN_TYPES.get(str(value.target), ())
    elif value.op == "call_function":
        try:
            found = _RETURN_TYPES.get(value.target, ())
        except TypeError:  # an unhashable callable: no torch function
            return ()
    else:
        return ()
    name = getattr(value.target, "__name__", value.target)
    if found and name in _BY_DIM:
        dim = value.args[1] if len(value.args) > 1 else value.kwargs.get("dim")
        return found if isinstance(dim, int) and not isinstance(dim, bool) else ()
    return found


def structure(value: fx.Node) -> bool:
    """Whether ``value`` is surely a structure, no tensor: its traced value
    is a dict or tuple (a torch.export node's), a torch call returns a
    namedtuple there (``torch.max(h, 1)``), or it is read as only a
    structure can be (``batch["x"]``, a field no tensor has, ``out.logits``)."""
    known = value.meta.get("val", value.meta.get("example_value"))
    if isinstance(known, (dict, tuple, list)) or fields(value):
        return True
    return any(
        u.op == "call_function"
        and len(u.args) > 1
        and u.args[0] is value
        and isinstance(u.args[1], str)
        and (u.target is operator.getitem or _no_tensor_attribute(u))
        for u in value.users
    )


def _no_tensor_attribute(node: fx.Node) -> bool:
    """Whether ``node`` is a ``getattr`` of a name no tensor has."""
    name = node.args[1]
    return node.target is getattr and isinstance(name, str) and not hasattr(torch.Tensor, name)


def _item(node: fx.Node) -> Any:
    """The key of the structure's item ``node`` reads (``batch["x"]``:
    ``"x"``, ``out.a``: ``"a"``, ``out[1]`` of a surely structure: ``1``),
    or None where it may index a tensor."""
    if node.op != "call_function" or len(node.args) < 2:
        return None
    container, key = node.args[0], node.args[1]
    if node.target is getattr:
        return _key(node) if _field(node) else None
    if node.target is not operator.getitem or not isinstance(container, fx.Node):
        return None
    if isinstance(key, str) or (isinstance(key, int) and structure(container)):
        return key
    return None


def updated(target: Any, *args: Any, **kwargs: Any) -> Any:
    """``target.update(...)``, giving ``target``: what a ``torch.fx`` trace
    records for ``batch.update(...)``, so that the code after it reads the
    dict it returns, as after ``batch |= {...}`` (a later stage then reads
    the updating stage's dict, not its own copy of the input)."""
    if isinstance(target, fx.Proxy):
        # A stage's code traced again (a pickled pipe loaded): stay a call.
        return target.tracer.create_proxy("call_function", updated, (target, *args), kwargs)
    if not isinstance(target, dict):
        # The tracer records an object's own ``update`` as a call of it
        # where the call traced holds the object; with no call, as a dict's.
        # A call's input is refused before anything runs (ChangedInputs.check).
        raise no_dict_update(type(target).__name__)
    target.update(*args, **kwargs)
    return target


def no_dict_update(kind: str, call: str = ".update(...)") -> TypeError:
    """The error for ``call``, a ``.update`` the trace took for a dict's,
    on a ``kind`` (no dict), and what to do."""
    return TypeError(
        f"forward calls {call} on a {kind}, which the trace took for a dict's update (the "
        f"call traced held a dict there, or no call was given): pass Pipe(..., sample=...), "
        f"a call holding a {kind} there, so that it is traced as the {kind}'s own method"
    )


def record_update(record: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Records ``args[0].update(*args[1:], **kwargs)`` as :func:`updated`
    by ``record`` (a tracer's ``create_proxy``), the proxy ``args[0]``
    standing for the dict it gives from then on, as ``batch |= {...}``
    makes the name ``batch`` (and every other name of that proxy) stand for
    it. Gives None, as ``update`` does."""
    proxy = record("call_function", updated, args, kwargs)
    # An attribute's node (``batch.inner``) is made on first use.
    node = "_node" if isinstance(args[0], fx.proxy.Attribute) else "node"
    args[0].__dict__[node] = proxy.node


def updates(node: fx.Node, changes: dict[fx.Node, fx.Node]) -> bool:
    """Whether ``node``, in ``changes``, is a dict update (``batch |= {"t":
    h}``, ``batch |= more``, traced as the augmented ``ior``, or
    ``batch.update(t=h)``, traced as :func:`updated`): it sets keys of a
    structure, and writes into no tensor, which every item keeps."""
    if node not in changes or not node.args:
        return False
    # The augmented assignment's call carries its operator's name last.
    name = getattr(node.target, "__name__", None)
    ior = name == "ior" or (name == "augmented" and node.args[2:] == ("ior",))
    if not ior and node.target is not updated and node.target is not replaced:
        return False
    target = node.args[0]
    return isinstance(_written(node), dict) or (isinstance(target, fx.Node) and structure(target))


def _written(node: fx.Node) -> Any:
    """What an update sets: a dict where the code writes its keys, else the
    value it sets from (a traced dict), or None."""
    if node.target is not updated:
        return node.args[1] if len(node.args) > 1 else None
    rest, more = node.args[1:], dict(node.kwargs)
    if not rest:
        return more
    if len(rest) == 1 and isinstance(rest[0], dict):
        return {**rest[0], **more}
    return None if more or len(rest) > 1 else rest[0]


def given(node: fx.Node, changes: dict[fx.Node, fx.Node]) -> dict[Any, Any]:
    """What a dict update sets, where the code writes its keys (``batch |=
    {"t": h}``: ``{"t": h}``); empty for any other ``node``."""
    value = _written(node) if updates(node, changes) else None
    return value if isinstance(value, dict) else {}


_UNSET = object()


def _set_at(node: fx.Node, changes: dict[fx.Node, fx.Node]) -> Any:
    """The value a dict update set at the key ``node``, a ``getitem``, reads
    of the update's result (``batch["t"]`` after ``batch |= {"t": h}``:
    ``h``), or a field set by :func:`~mpstream.stages.field_writes.replaced`
    (``batch.inner``); ``_UNSET`` where no update set it."""
    if len(node.args) < 2 or not isinstance(container := node.args[0], fx.Node):
        return _UNSET
    field = node.target is getattr and container.target is replaced
    if node.target is not operator.getitem and not field:
        return _UNSET
    key = node.args[1]
    if isinstance(key, (fx.Node, slice)):
        return _UNSET
    try:
        value = given(container, changes).get(key, _UNSET)
    except TypeError:  # an unhashable key: none the update set
        return _UNSET
    if isinstance(value, fx.Node):
        return value
    held: list[fx.Node] = []
    fx.node.map_arg(value, held.append)
    # A structure of traced values (``{"t": (h, g)}``) stays an item of the
    # dict, as before the update: its items' memories are not followed.
    return _UNSET if held else value


def _key(node: fx.Node) -> Any:
    """The key ``node`` (a ``getitem``, or a ``getattr`` of a field) reads:
    a torch call's namedtuple field by its index (``m.values``: ``0``, as
    ``m[0]``), which tells it apart from the others."""
    container, key = node.args[0], node.args[1]
    if node.target is getattr and isinstance(container, fx.Node) and key in fields(container):
        return fields(container).index(key)
    return key


def base(node: fx.Node, changes: dict[fx.Node, fx.Node]) -> fx.Node:
    """The value that owns the memory ``node`` views (itself if no view)."""
    while (owner := viewed(node, changes)) is not None:
        node = owner
    return node


def path(value: fx.Node, changes: dict[fx.Node, fx.Node]) -> tuple[Any, ...]:
    """The keys and indices that reach ``value`` from the input it views
    (``batch["x"][0].view(-1)``: ``("x", 0)``), as far as they are constants;
    past a tensor they index it, which :func:`~mpstream.stages.inplace.own`
    copies whole."""
    keys: list[Any] = []
    node = value
    while (owner := viewed(node, changes)) is not None:
        key = None
        # An item, or a namedtuple's field (``batch.x``); not a key a dict
        # update set, which holds the value set.
        if _set_at(node, changes) is _UNSET and (
            node.target is operator.getitem or (node.target is getattr and _field(node))
        ):
            key = _key(node)
        # Only the run of constant keys next to the input leads somewhere known.
        keys = [key, *keys] if isinstance(key, (str, int)) and not isinstance(key, bool) else []
        node = owner
    return tuple(keys)


def written(node: fx.Node, changes: dict[fx.Node, fx.Node]) -> tuple[fx.Node, Steps] | None:
    """The value ``node`` is an item of, and the steps the code takes from
    there, as :func:`~mpstream.stages.lookups.item_name` spells them
    (``batch[0]["t"]``: ``batch`` and ``(("[", 0), ("[", "t"))``;
    ``batch.inner``: ``((".", "inner"),)``), through in-place changes and
    the keys a dict update set (the value set is that object). None where
    anything else lies between (a view: ``h.view(-1)``)."""
    steps: list[tuple[str, Any]] = []
    while (owner := viewed(node, changes)) is not None:
        # A key a dict update set leads on to the value set (viewed); a field
        # field_writes.replaced set is read of the owner: a step of it.
        set_key = node.target is operator.getitem and _set_at(node, changes) is not _UNSET
        if node not in changes and not set_key:
            key = node.args[1] if len(node.args) > 1 else None
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                return None
            if node.target is operator.getitem:
                steps.insert(0, ("[", key))
            elif node.target is getattr and _field(node):
                steps.insert(0, (".", key))
            else:
                return None
        node = owner
    return node, tuple(steps)


def updated_inputs(
    changes: dict[fx.Node, fx.Node],
) -> dict[fx.Node, tuple[tuple[Steps, bool], ...]]:
    """Each input (its placeholder, before
    :func:`~mpstream.stages.inplace.copy_changed_inputs` copies it) holding
    a dict the forward updates in place (``batch |= {...}``,
    ``batch["inner"]["t"] = h``), with the steps to each such dict in it
    and whether ``.update`` updates it, which the trace took for a dict's
    (see :meth:`~mpstream.stages.shared_inputs.ChangedInputs.check`)."""
    found: dict[fx.Node, dict[tuple[Steps, bool], None]] = {}
    for node in changes:
        method = node.target is updated
        reached = written(changes[node], changes) if method or updates(node, changes) else None
        if reached is not None and reached[0].op == "placeholder":
            found.setdefault(reached[0], {})[reached[1], method] = None
    return {holder: tuple(found_in) for holder, found_in in found.items()}


def memory(node: fx.Node, changes: dict[fx.Node, fx.Node]) -> tuple[fx.Node, tuple[Any, ...]]:
    """The value owning ``node``'s memory and the keys of the items of it
    that ``node`` views (``batch["x"][0]``: ``batch`` and ``("x",)``; a
    tensor's view or any item of a leaf module's result: ``()``, the whole)."""
    keys: list[Any] = []
    while (owner := viewed(node, changes)) is not None:
        # A key a dict update set holds the value set: no item of the dict.
        key = None if _set_at(node, changes) is not _UNSET else _item(node)
        # Only the run of items next to the owner is apart from the rest: an
        # item of a view (``x.split(2)[0]``) is a view of the whole.
        keys = [key, *keys] if isinstance(key, (str, int)) and not isinstance(key, bool) else []
        node = owner
    if node.op == "call_module":
        # A leaf module's items may share memory (a model output's
        # last_hidden_state is its hidden_states[-1]), which fx cannot see.
        return node, ()
    return node, tuple(keys)


def overlap(keys: tuple[Any, ...], other: tuple[Any, ...]) -> bool:
    """Whether the items at ``keys`` and ``other`` of one value may share
    memory: unless they part at two keys surely apart (two names, or two
    indices counted from the front; ``out[0]`` may be ``out.a``, ``out[-1]``
    any item)."""
    for a, b in zip(keys, other):
        names = isinstance(a, str) and isinstance(b, str)
        indices = isinstance(a, int) and isinstance(b, int) and a >= 0 and b >= 0
        if a != b and (names or indices):
            return False
    return True

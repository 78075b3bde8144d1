"""The ``torch.fx`` tracer a split traces with.

:class:`Tracer` is fx's own, treating the user's leaf modules as leaves and
remembering which submodule it is inside, for error messages. It answers
what a forward looks up in its arguments from the call traced (see
:mod:`~mpstream.stages.lookups`), records a dict update so that later
stages read the updated dict (see :mod:`~mpstream.stages.item_writes`), and
refuses an operation recorded in another grad or autocast mode than the
trace began in (see :mod:`~mpstream.stages.unrecorded`).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from ..memory import DeferredBatchNorm
from .inplace import augmented
from .inplace_paths import record_update
from .item_writes import write_back, write_item
from .lookups import Item, Lookup, item_name, value_at
from .proxies import AugmentedProxy, item_of
from .unrecorded import check_modes, current_modes

__all__ = ["Tracer"]


# What Tracer.create_proxy records as it is (see Tracer._pop_or_setdefault).
_AS_CODE = object()

# A key forward popped (see Tracer.known).
_GONE = object()

# Defaults setdefault may hand back as they are: the dict holds the same
# value. Any other (a list to append to) is the recorded call's result, so
# that what forward does to it is done to the stage's dict's own.
_IMMUTABLE = (bool, int, float, complex, str, bytes, torch.dtype, torch.device)

# Methods that change a dict or list in place (a proxy has no __setitem__).
_CHANGES = frozenset(
    ("setdefault", "update", "pop", "popitem", "clear")  # a dict's
    + ("append", "extend", "insert", "remove", "reverse", "sort")  # a list's
)


class Tracer(fx.Tracer):
    """``torch.fx``'s tracer, remembering which submodule it is inside (for
    error messages) and treating the user's leaf modules as leaves.

    Args:
        leaves: the user's leaf modules, by qualified name or type.
        none_items: items of the arguments that are None in the call
            traced (``batch['mask']``, ``batch.scales.shift``, as
            :func:`~mpstream.stages.tracers.nones_of` names them): reading
            one gives None, not a value, so ``if batch['mask'] is not None:``
            is not taken, as it would not be when the module runs.
        values: the call traced, every argument by name, which answers
            ``batch.get(key)``, ``batch.pop(key, d)`` and ``key in batch``
            for a key it leaves out of a dict as the module would; None:
            every key present.
        lookups: where to add each lookup the trace makes (see
            :mod:`~mpstream.stages.lookups`), a failed trace's too.
    """

    def __init__(
        self,
        leaves: Sequence[str | type[nn.Module]],
        none_items: frozenset[str] = frozenset(),
        values: Mapping[str, Any] | None = None,
        lookups: set[Lookup] | None = None,
    ) -> None:
        super().__init__()
        # A set: a slice of a sequence holding None items names them anew.
        self.none_items = set(none_items)
        self.values = values
        self.lookups = set[Lookup]() if lookups is None else lookups
        # Arguments and items forward changed in place (batch.update(more),
        # a list's append): the call no longer answers what they hold, nor
        # what is inside.
        self.changed: list[Item] = []
        # Keys forward popped (_GONE) or set (by setdefault, or an update
        # with keys in the code: the value given), each with its dict, until
        # the dict changes otherwise: so, whatever the call held; the
        # dict's other keys stay as the call holds them.
        self.known: dict[tuple[Item, Any], Any] = {}
        self.leaf_names = {x for x in leaves if isinstance(x, str)}
        self.leaf_types = tuple(x for x in leaves if isinstance(x, type))
        self.path: list[str] = []
        self.failed_in: str | None = None  # the innermost submodule that raised
        self.modes = current_modes()

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return AugmentedProxy(node, self)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        # fx records operations, not the grad or autocast mode they run in
        # (a ``with torch.no_grad():`` block in forward is dropped, its
        # values then carry gradients).
        check_modes(self.modes)
        return super().create_node(*args, **kwargs)

    def create_proxy(
        self, kind: str, target: Any, args: Any, kwargs: Any, *rest: Any, **more: Any
    ) -> Any:
        item: Item | None = None
        parent = None  # the proxy of the dict holding this item (see item_writes)
        held = False  # a dict held in another, changed by ``|=``: written back
        if kind == "call_method" and target in ("pop", "setdefault") and len(args) > 1:
            answered = self._pop_or_setdefault(target, args, kwargs, *rest, **more)
            if answered is not _AS_CODE:
                return answered
        if (kind == "call_method" and target in _CHANGES and args) or (
            kind == "call_function" and target is augmented and args
        ):
            # `other = batch; other |= {...}` changes batch too: lookups
            # through either name see the change.
            changed = item_of(args[0])
            if changed is not None:
                if not self._update(changed, target, args, kwargs):
                    self._change(changed)
                if target is augmented:
                    item = changed  # the same dict: a test on it is refused by name
                    parent = args[0].__dict__.get("_owner")
                    held = self._dict_update(changed, target, args)
                elif target == "update" and self._dict_update(changed, target, args):
                    # ``batch |= {...}`` written otherwise; a namedtuple's
                    # or dataclass's own ``update`` is a call as any other.
                    record_update(super().create_proxy, args, kwargs)
                    write_back(self, args[0])
                    return None
        if kind == "placeholder":
            item = (str(target), ())
        elif (kind == "call_function" and target is operator.getitem) or (
            kind == "call_method" and target == "get" and len(args) > 1
        ):
            # batch[k] or batch.get(k): a key written in the code (a str,
            # int, tuple...), named as nones_of names it; never a traced one.
            owner = item_of(args[0])
            known = _GONE if owner is None else self._known(owner, args[1])
            if known is not _GONE:
                return known  # what forward set there
            if owner is not None and self._hashable(owner, args[1]) in self.known:
                if kind == "call_method":
                    return args[2] if len(args) > 2 else None
                owner = None  # recorded as it is: a KeyError, as the module raises
            if owner is not None and not isinstance(args[1], fx.Proxy) and not self._changed(owner):
                if kind == "call_method" and self._look_up(owner, args[1], test=False) is False:
                    return args[2] if len(args) > 2 else None  # the key left out: the default
                item, parent = (owner[0], (*owner[1], ("[", args[1]))), args[0]
                if item_name(item) in self.none_items:
                    return None  # the item is None: no operation to record
                if isinstance(args[1], slice):
                    self._name_sliced(item_name(owner), args[1], item_name(item))
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **more)
        if item is not None:
            proxy.__dict__.update(_item=item, _owner=parent)
        if held:  # ``inner = batch["inner"]; inner |= {...}`` changes batch["inner"] too
            write_back(self, proxy)
        return proxy

    def set_item(self, target: fx.Proxy, key: Any, value: Any) -> None:
        """``target[key] = value`` (see :func:`~mpstream.stages.item_writes.write_item`)."""
        write_item(self, target, key, value)

    def _pop_or_setdefault(
        self, method: str, args: Any, kwargs: Any, *rest: Any, **more: Any
    ) -> Any:
        """``owner.pop(key, ...)`` or ``owner.setdefault(key, ...)`` for a
        key written in the code, answered from the call (or from what
        forward popped or set before: ``known``) where the module would
        leave the dict as it is: a key left out popped with a default
        gives the default, a key held as None set by default gives None,
        recording nothing. Else recorded (the stage changes its dict as
        the module does), the key's new state known; ``_AS_CODE`` where
        the call cannot answer (no dict there, a traced key, a dict
        changed otherwise already)."""
        owner, key = item_of(args[0]), args[1]
        if owner is None or isinstance(key, fx.Proxy) or kwargs or self._changed(owner):
            return _AS_CODE
        known = self._known(owner, key)  # popped or set already: whatever the call holds
        if known is not _GONE and method == "setdefault":
            return known  # held: the dict stays as it is
        if known is not _GONE:
            present: bool | None = True  # set by forward
        elif self._hashable(owner, key) in self.known:
            present = False  # popped by forward
        else:
            present = self._look_up(owner, key, test=False)
        if present is None:  # no dict: a call of the object's own method
            return _AS_CODE
        default = args[2] if len(args) > 2 else None
        item: Item = (owner[0], (*owner[1], ("[", key)))
        is_none = item_name(item) in self.none_items if known is _GONE else known is None
        if method == "pop":
            if not present and len(args) > 2:
                return default  # nothing to pop: the dict stays as it is
            # Gone from here on (or a KeyError, as the module raises); the
            # dict's other keys are still as the call holds them.
            self.known[owner, key] = _GONE
            proxy = super().create_proxy("call_method", method, args, kwargs, *rest, **more)
            proxy.__dict__["_item"] = item  # the call's: isinstance on it is answered
            return None if is_none else proxy if known is _GONE else known
        if not present:  # the key is set: the dict changes, at the stage too
            proxy = super().create_proxy("call_method", method, args, kwargs, *rest, **more)
            given = (
                default
                if default is None or isinstance(default, (fx.Proxy, *_IMMUTABLE))
                else proxy
            )
            self.known[owner, key] = given
            return given
        if is_none:
            return None  # held as None: setdefault leaves it and gives None
        proxy = super().create_proxy("call_method", method, args, kwargs, *rest, **more)
        proxy.__dict__.update(_item=item, _owner=args[0])  # the dict in it: item_writes
        return proxy

    def contains(self, proxy: fx.Proxy, key: object) -> bool:
        """``key in proxy``, answered from the call traced.

        Raises:
            TypeError: no call is traced (the first trace without
                ``sample=``), the call holds no mapping there, or the key
                is traced.
        """
        owner = item_of(proxy)
        if owner is None or isinstance(key, fx.Proxy):
            self.iter(proxy)  # fx's own error: it cannot trace iterating a value
        assert owner is not None
        where = f"forward tests {key!r} in {item_name(owner)}"
        if self._hashable(owner, key) in self.known:
            return self.known[owner, key] is not _GONE  # forward popped or set it
        if self._changed(owner):
            raise TypeError(
                f"{where} after changing it in place, which a trace cannot answer from "
                f"the call: test the key before the change"
            )
        if self.values is None:
            raise TypeError(
                f"{where}, which a trace answers from a call, and none was given: pass "
                f"Pipe(..., sample=...), a call like those to come"
            )
        present = self._look_up(owner, key, test=True)
        if present is None:
            raise TypeError(
                f"{where}, which the call holds as no mapping (a dict): a traced pipeline "
                f"answers `key in ...` for a dict argument or item"
            )
        return present

    def _update(self, owner: Item, method: Any, args: Any, kwargs: Any) -> bool:
        """``owner.update(...)`` or ``owner |= {...}`` with keys and values
        written in the code (a dict, keywords): each key known to hold its
        value from now on, the dict's other keys still answered from the
        call. False where they are not known (a dict traced, a mutable
        value) or ``owner`` is no dict in the call. With no call given, a
        dict's update as :meth:`_dict_update` takes it: a later read of a
        key set is the value set, as with a call (``inner.update(k=v)``
        writes ``inner`` back into ``batch``, and ``batch["inner"]["s"] =
        h`` then sets a key of that dict)."""
        if method == "update" and len(args) <= 2:
            given, more = (args[1] if len(args) == 2 else {}), kwargs
        elif method is augmented and len(args) == 3 and args[2] == "ior":
            given, more = args[1], {}
        else:
            return False
        if type(given) is not dict or self._changed(owner):
            return False
        entries: dict[tuple[Item, Any], Any] = {}
        for key, value in {**given, **more}.items():
            entry = self._hashable(owner, key)
            if entry is None or not (value is None or isinstance(value, (fx.Proxy, *_IMMUTABLE))):
                return False
            entries[entry] = value
        if self.values is not None and Lookup(owner, None, test=False).present(self.values) is None:
            return False  # no dict there: the object's own method
        self.known.update(entries)
        return True

    def _dict_update(self, item: Item, method: Any, args: Any) -> bool:
        """Whether ``item.update(...)`` or ``item |= ...`` (``method``) is a
        dict's: the call holds a dict there, or, with no call given, it is
        ``update`` (:func:`~mpstream.stages.inplace_paths.updated` refuses
        another object at run time) or ``|=`` with a dict written in the code."""
        if method is augmented and (len(args) != 3 or args[2] != "ior"):
            return False
        if self.values is not None:
            return isinstance(value_at(self.values, item), dict)
        return method == "update" or isinstance(args[1], dict)

    def _change(self, item: Item) -> None:
        """Marks ``item`` changed in place: what forward popped from it, or
        set in it or in what it holds, is no longer known (an update may
        bring a key back, or replace it)."""
        self.changed.append(item)
        name, steps = item
        self.known = {
            (o, k): v
            for (o, k), v in self.known.items()
            if not (o[0] == name and o[1][: len(steps)] == steps)
        }

    def _known(self, owner: Item, key: Any) -> Any:
        """What forward set at ``key`` in ``owner`` by ``setdefault``;
        ``_GONE`` where it set nothing there (or popped it)."""
        entry = self._hashable(owner, key)
        return _GONE if entry is None else self.known.get(entry, _GONE)

    @staticmethod
    def _hashable(owner: Item, key: Any) -> tuple[Item, Any] | None:
        """``(owner, key)`` where both hash (no slice on the way, a key
        written in the code: never a traced one, whose ``==`` would record
        a call); else None, which ``known`` never holds."""
        if isinstance(key, fx.Proxy):
            return None
        try:
            hash((owner, key))
        except TypeError:
            return None
        return owner, key

    def _changed(self, item: Item) -> bool:
        """Whether forward changed ``item``, or what holds it, in place."""
        name, steps = item
        return any(c[0] == name and steps[: len(c[1])] == c[1] for c in self.changed)

    def _look_up(self, owner: Item, key: Any, *, test: bool) -> bool | None:
        """Whether the call holds ``key`` in ``owner`` (present where no call
        is given), recording the lookup; None where the call holds no
        mapping there, or the key is no dict key."""
        lookup = Lookup(owner, key, test)
        try:
            self.lookups.add(lookup)
        except TypeError:  # unhashable: no dict's key
            return None
        return True if self.values is None else lookup.present(self.values)

    def _name_sliced(self, item: str, key: slice, label: str) -> None:
        """Names the None items of ``item[key]`` (``label``), a slice of a
        list or tuple holding some, by their places in the slice."""
        under: dict[int, list[str]] = {}  # per index of item, what is None at it
        pattern = re.compile(re.escape(item) + r"\[(-?\d+)\]")
        for name in self.none_items:
            found = pattern.match(name)
            if found is not None:
                under.setdefault(int(found.group(1)), []).append(name[found.end() :])
        ahead = [i for i in under if i >= 0]
        back = [i for i in under if i < 0]
        if not ahead or not back:
            return  # not a sequence holding a None item (nones_of names both ways)
        # Its first None item, by index and from the end: its length.
        picked = range(min(ahead) - min(back))[key]
        n = len(picked)
        for k, i in enumerate(picked):
            for rest in under.get(i, ()):
                self.none_items.update((f"{label}[{k}]{rest}", f"{label}[{k - n}]{rest}"))

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname in self.leaf_names or (self.leaf_types and isinstance(m, self.leaf_types)):
            return True
        if isinstance(m, DeferredBatchNorm):
            # Ours, so not a leaf to fx, but its statistics bookkeeping is
            # Python control flow fx cannot trace; a BatchNorm it replaced was one.
            return True
        return bool(super().is_leaf_module(m, qualname))

    def call_module(
        self,
        m: nn.Module,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        self.path.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.path[-1]
            raise
        finally:
            self.path.pop()

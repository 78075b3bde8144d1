"""What a traced ``forward`` looks up in its arguments: a dict's keys
(``batch.get("s")``, ``"s" in batch``) and an argument's type
(``isinstance(batch, dict)``).

The plain module reads a key the call leaves out of a dict as the code
says: ``batch.get("s")`` is None, ``batch.get("s", 0.0)`` the default,
``"s" in batch`` False, ``batch.pop("s", 0.0)`` the default (and
``batch.setdefault("s", v)`` None for a key the call holds as None).
``torch.fx`` would trace each as a value (and fail on ``in``), so a split
traced with the key present would run a call without it. The
:class:`~mpstream.stages.fx_tracer.Tracer` answers each such lookup from
the call it traces and records it (with no call, the first trace without
``sample=``, a ``.get`` as present, as every argument is taken as given,
and a test refused); the set of keys a trace looked up is known only
after the trace, so a pipe keeps the lookups of
all its traces (see :mod:`~mpstream.stages.traced`), and
:func:`missing_keys` tells which of them a call leaves out: part of the
call's kind. So is the type of each argument, or item of one, whose type
the trace tested (see :mod:`~mpstream.stages.type_tests`): an fx proxy is
no dict, tuple or tensor, so ``isinstance(batch, dict)`` would be False
whatever the call holds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..runtime.microbatch import NoChunk

__all__ = ["Item", "Lookup", "item_name", "missing_keys", "value_at", "NOTHING"]

# Where a value sits in a call: the argument's name and the steps from it,
# ``("[", key)`` for an item, ``(".", name)`` for a field.
Item = tuple[str, tuple[tuple[str, Any], ...]]


def item_name(item: Item) -> str:
    """The item as :func:`~mpstream.stages.tracers.nones_of` names it
    (``batch['x']``, ``batch.inner.shift``)."""
    name, steps = item
    return name + "".join(f"[{k!r}]" if op == "[" else f".{k}" for op, k in steps)


@dataclass(frozen=True)
class Lookup:
    """A constant key a trace looked up in an argument or an item of one.

    Or, ``typed``, the type of an argument or item of one (``owner``) a
    trace tested (``isinstance(batch, dict)``), ``key`` None.

    Attributes:
        owner: the dict it was looked up in.
        key: the key (a constant in the code).
        test: ``key in owner`` (else ``owner.get(key)``).
        typed: the type of ``owner`` (a default: pickled before it was one).
    """

    owner: Item
    key: Any
    test: bool
    typed: bool = False

    @functools.cached_property
    def name(self) -> str:
        """The item looked up (``batch['s']``), or its type (``type(batch)``)."""
        if self.typed:
            return f"type({item_name(self.owner)})"
        return item_name(self.owner) + f"[{self.key!r}]"

    def type_in(self, values: Mapping[str, Any]) -> str:
        """What the call holds at ``owner``, for a typed lookup: ``type(batch)
        is dict`` (``is absent`` where it holds nothing there)."""
        value = value_at(values, self.owner)
        kind = type(value)
        if value is NOTHING:
            return f"{self.name} is absent"
        if kind.__module__ == "builtins":
            return f"{self.name} is {kind.__qualname__}"
        return f"{self.name} is {kind.__module__}.{kind.__qualname__}"

    def present(self, values: Mapping[str, Any]) -> bool | None:
        """Whether a call (every argument by name) holds the key: None where
        the owner is no mapping in that call."""
        if self.typed:
            return None  # no key: see type_in
        owner = value_at(values, self.owner)
        # A dict by its type first: a call of the pipe's pays for this.
        return self.key in owner if type(owner) is dict or isinstance(owner, Mapping) else None


# What a call holds where it holds nothing (see value_at).
NOTHING = object()


def value_at(values: Mapping[str, Any], item: Item) -> Any:
    """The value at ``item`` in a call (every argument by name), or
    :data:`NOTHING` where the call holds none there (never a user object's attribute: only a
    namedtuple's or dataclass's field)."""
    name, steps = item
    value = values.get(name, NOTHING)
    for op, key in steps:
        if op == ".":
            fields = getattr(type(value), "_fields", None) if isinstance(value, tuple) else None
            if fields is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
                fields = [f.name for f in dataclasses.fields(value)]
            if fields is None or key not in fields:
                return NOTHING
            value = getattr(value, key)
        elif isinstance(value, Mapping):
            if key not in value:
                return NOTHING
            value = value[key]
        elif isinstance(value, (list, tuple)) and type(key) is int:
            if not -len(value) <= key < len(value):
                return NOTHING
            value = value[key]
        else:
            return NOTHING
    # Every micro-batch gets the tensor NoChunk wraps: the stage's value.
    return value.tensor if isinstance(value, NoChunk) else value


def missing_keys(values: Mapping[str, Any], lookups: Iterable[Lookup]) -> frozenset[str]:
    """The lookups a call does not answer as the trace without a call did
    (the key present in a mapping), by name: the keys it leaves out, and
    each ``in`` test on what is no mapping in the call (which the tracer
    then refuses, with what to do), named apart: a split traced with the
    key left out of a dict answers the test False. A ``.get`` on another
    object is a method call the stage makes as the module does. A typed
    lookup names the type the call holds there (``type(batch) is dict``),
    so that a call of another type is another kind."""
    found = set()
    for lookup in lookups:
        if lookup.typed:
            found.add(lookup.type_in(values))
            continue
        present = lookup.present(values)
        if present is False:
            found.add(lookup.name)
        elif present is None and lookup.test:
            found.add(f"{lookup.name} (no mapping)")
    return frozenset(found)

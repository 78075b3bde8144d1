"""``batch[k] = v`` on a dict argument, while ``torch.fx`` traces.

fx's proxy has no ``__setitem__``, so a forward setting a key of its dict
argument (``batch["t"] = h``, or of a dict in it, ``batch["inner"]["t"] =
h``, ``batch["inner"] |= {...}``) failed with Python's own error.
:func:`write_item` records it as ``batch.update({"t": h})``, which the
tracer records as :func:`~mpstream.stages.inplace_paths.updated`: the name
then stands for the updated dict, so the stages after it read the dict the
writing stage returns. A dict inside one, however it is updated
(``inner = batch["inner"]`` then ``inner["t"] = h``, ``inner |= {...}`` or
``inner.update(...)``), is written back into its owner the same way
(:func:`write_back`: ``batch |= {"inner": inner}``), so a later stage reads
it through the owner too; so is a dict in a namedtuple's or dataclass's
field (``batch.inner``: :mod:`~mpstream.stages.field_writes`). Anything
else is refused by name.
"""

from __future__ import annotations

from typing import Any

from torch import fx

from .field_writes import record_replace
from .inplace_paths import updated
from .lookups import NOTHING, item_name, value_at
from .proxies import item_of

__all__ = ["write_item", "write_back"]


def write_item(tracer: Any, target: fx.Proxy, key: Any, value: Any) -> None:
    """``target[key] = value``, recorded by ``tracer`` (an
    :class:`~mpstream.stages.fx_tracer.Tracer`) as ``target.update({key:
    value})`` where ``target`` is a dict argument or a dict in one.

    Raises:
        TypeError: ``target`` is no dict argument or item of one (a tensor:
            torch.fx cannot record ``h[:, 0] = 0``, torch.export can), or
            the key is traced.
    """
    owner = item_of(target)
    if owner is None:
        raise TypeError(f"'{type(target).__name__}' object does not support item assignment")
    name = item_name(owner)
    if isinstance(key, fx.Proxy):
        raise TypeError(
            f"forward sets a key of {name} that it computes ({key}), which a traced "
            f"pipeline cannot follow: set a key written in the code, or pass tracer='export'"
        )
    where = f"forward sets {name}[{key!r}]"
    values = tracer.values
    held = NOTHING if values is None else value_at(values, owner)
    if values is None and not isinstance(key, str):
        raise TypeError(
            f"{where}, which a trace takes for a dict's key where the call holds a dict "
            f"there, and no call was given: pass Pipe(..., sample=...), a call like those "
            f"to come"
        )
    if values is not None and not isinstance(held, dict):
        raise TypeError(
            f"{where}, an item of {_what(held)}, which torch.fx cannot record: set keys of "
            f"a dict argument only, or pass tracer='export'"
        )
    if isinstance(value, fx.Proxy) and _set_last(target, key, value):
        # ``batch["inner"] |= {...}``: Python sets the dict back after the
        # tracer wrote it back (write_back), which changes nothing.
        return
    # The path ``batch |= {key: value}`` takes (the tracer records it, and
    # writes the dict back into its owner).
    tracer.create_proxy("call_method", "update", (target, {key: value}), {})


def write_back(tracer: Any, changed: fx.Proxy) -> None:
    """After ``changed``, a dict held in another (``inner =
    batch["inner"]``), was updated in place (``inner |= {...}``,
    ``inner["t"] = v``, ``inner.update(...)``), its owner holds the updated
    dict (``batch |= {"inner": inner}``, recorded by ``tracer``; in a
    namedtuple's or dataclass's field, ``batch.inner``, the owner is
    replaced by one holding it: :func:`~mpstream.stages.field_writes.replaced`),
    and so on up to the argument: a later stage reads it through the owner
    too, as the module does. A dict held in what takes no key (a list, or
    a key not a string with no call given) is left where it is: the
    in-place check refuses a later stage's stale read of it
    (:func:`~mpstream.stages.inplace_check.check_in_place`)."""
    owner, item = changed.__dict__.get("_owner"), item_of(changed)
    if owner is None or item is None or not item[1]:
        return
    name, steps = item
    op, key = steps[-1]
    if op == ".":
        # A field (``batch.inner``): the call holds a namedtuple or dataclass
        # there (value_at reads no other's), or no call was given.
        if tracer.values is None or value_at(tracer.values, item) is not NOTHING:
            record_replace(tracer, owner, key, changed)
            write_back(tracer, owner)  # the owner, changed, held in another in turn
        return
    if tracer.values is None:
        takes = isinstance(key, str)  # write_item's dict key, with no call given
    else:
        takes = isinstance(value_at(tracer.values, (name, steps[:-1])), dict)
    if takes:
        write_item(tracer, owner, key, changed)


def _set_last(target: fx.Proxy, key: Any, value: fx.Proxy) -> bool:
    """Whether the last change of ``target`` set ``key`` (the same object)
    to ``value`` alone, and nothing changed it since."""
    last = target.node
    given = last.args[1] if last.target is updated and len(last.args) == 2 else None
    if not isinstance(given, dict) or len(given) != 1 or last.kwargs:
        return False
    ((set_key, set_value),) = given.items()
    return set_key is key and set_value is value.node


def _what(held: Any) -> str:
    if held is NOTHING:
        return "nothing the call holds"
    return f"a {type(held).__name__} in the call"

"""A dict held in a namedtuple's or dataclass's field, updated in a traced stage.

``inner = batch.inner`` then ``inner |= {"t": h}`` (or ``inner["t"] = h``,
``inner.update(t=h)``) changes the dict the module's ``batch`` holds, so a
later read of ``batch.inner`` sees the key. A stage passes values instead
of sharing them: a later stage would read its own ``batch``, holding the
dict unchanged. A namedtuple takes no new field in place, so the trace
records the write-back as :func:`replaced` (``batch._replace(inner=inner)``;
at run time ``batch`` itself, which holds the dict updated in place already),
and the name ``batch`` stands for the result from then on
(:func:`record_replace`), as ``batch |= {"inner": inner}`` does for a dict
(:mod:`~mpstream.stages.item_writes`): the stages after it read the
``batch`` the writing stage returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import fx

__all__ = ["replaced", "record_replace"]


def replaced(target: Any, fields: dict[str, Any]) -> Any:
    """``target``, a namedtuple or dataclass, with ``fields`` set: what a
    ``torch.fx`` trace records where a dict held in a field of it was
    updated (the dict is the same object; the stages after read it through
    the result). ``target`` itself where its fields hold those values
    already, as after an update in place: then it may be any object.

    Raises:
        TypeError: ``target`` is neither, and a field holds another value.
    """
    if isinstance(target, fx.Proxy):
        # A stage's code traced again (a pickled pipe loaded): stay a call.
        return target.tracer.create_proxy("call_function", replaced, (target, fields), {})
    if all(getattr(target, k, None) is v for k, v in fields.items()):
        # The dict was updated in place, so the object holds it already
        # (whatever its type, a trace with no call cannot tell): the node
        # only hands the later stages this object. A copy would rerun a
        # dataclass's __init__ (its __post_init__) for nothing.
        return target
    if isinstance(target, tuple) and hasattr(target, "_replace"):
        return target._replace(**fields)
    if dataclasses.is_dataclass(target) and not isinstance(target, type):
        return dataclasses.replace(target, **fields)
    raise TypeError(
        f"forward updates a dict held in field(s) {', '.join(map(repr, fields))} of a "
        f"{type(target).__name__}, which the trace took for a namedtuple or dataclass: pass "
        f"Pipe(..., sample=...), a call like those to come"
    )


def record_replace(tracer: Any, owner: fx.Proxy, field: str, value: fx.Proxy) -> None:
    """Records ``owner = replaced(owner, {field: value})`` by ``tracer``: the
    proxy ``owner`` (and every other name of it) stands for the result from
    then on."""
    proxy = tracer.create_proxy("call_function", replaced, (owner, {field: value}), {})
    # An attribute's node (``batch.inner``) is made on first use.
    node = "_node" if isinstance(owner, fx.proxy.Attribute) else "node"
    owner.__dict__[node] = proxy.node

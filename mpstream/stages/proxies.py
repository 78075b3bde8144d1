"""The proxy a ``torch.fx`` trace of a stage's module makes.

fx's own has no augmented assignment (``h += y`` would run ``h = h + y``, a
new tensor where the module changes ``h``), no ``__contains__`` and no
``__setitem__``: :class:`AugmentedProxy` records the first as
:func:`~mpstream.stages.inplace.augmented` and hands the others to its
tracer (:class:`~mpstream.stages.fx_tracer.Tracer`). :func:`item_of` says
which argument, or item of one, a proxy is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import fx

from .inplace import augmented
from .lookups import Item, item_name

__all__ = ["AugmentedProxy", "AugmentedAttribute", "item_of"]

# Each augmented assignment's in-place operator, by name.
_AUGMENTED = (
    "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor",
    "imatmul", "ilshift", "irshift",
)  # fmt: skip


class AugmentedProxy(fx.Proxy):
    """fx's proxy, recording an augmented assignment (``h += y``) as the
    in-place operation it is. fx's own has no ``__iadd__`` and the like, so
    Python would run ``h = h + y``: a new tensor, where the module changes
    ``h`` and every view of it (``v = h[:, :2]; h += 1`` changes ``v``).
    Nor has it ``__contains__``: ``"s" in batch`` would iterate it (which
    fails); the tracer answers it (see :mod:`~mpstream.stages.lookups`),
    nor ``__setitem__`` (see :mod:`~mpstream.stages.item_writes`)."""

    def __contains__(self, key: object) -> bool:
        return self.tracer.contains(self, key)  # type: ignore[attr-defined,no-any-return]

    def __setitem__(self, key: Any, value: Any) -> None:
        # ``batch["t"] = h``: recorded as ``batch |= {"t": h}`` (item_writes).
        self.tracer.set_item(self, key, value)  # type: ignore[attr-defined]


def _in_place(op: str) -> Callable[[fx.Proxy, Any], fx.Proxy]:
    def method(self: fx.Proxy, other: Any) -> fx.Proxy:
        # An input too (``v = x[:, :2]; x += 1`` changes ``v``): it gets a
        # copy per micro-batch (copy_changed_inputs), the caller's unchanged.
        return self.tracer.create_proxy("call_function", augmented, (self, other, op), {})

    return method


class AugmentedAttribute(fx.proxy.Attribute, AugmentedProxy):
    """An attribute read off an :class:`AugmentedProxy` (``h = x.T``,
    ``out.logits``): fx's own has no ``__iadd__`` either, so ``h += 1``
    would not change ``x``."""


def _attribute(self: fx.Proxy, k: str) -> fx.proxy.Attribute | None:
    item = item_of(self)
    if item is None:
        return AugmentedAttribute(self, k)
    field: Item = (item[0], (*item[1], (".", k)))
    if item_name(field) in self.tracer.none_items:  # type: ignore[attr-defined]
        return None  # a field the traced call holds None in
    attribute = AugmentedAttribute(self, k)
    # Its owner: a dict in the field, updated, is written back (item_writes).
    attribute.__dict__.update(_item=field, _owner=self)
    return attribute


def item_of(value: Any) -> Item | None:
    """Which argument, or item of one, a proxy is (``batch``, ``batch['x']``,
    ``batch.scales``), where the tracer traces some items as None and
    answers lookups (see :class:`~mpstream.stages.fx_tracer.Tracer`); else None."""
    # Not getattr: a proxy's attribute is a traced operation.
    return value.__dict__.get("_item") if isinstance(value, fx.Proxy) else None


AugmentedProxy.__getattr__ = _attribute  # type: ignore[method-assign,assignment]
for _op in _AUGMENTED:
    setattr(AugmentedProxy, f"__{_op}__", _in_place(_op))

"""What a stage's graphs baked in, as keys: its fingerprint and a call's signature.

A replay reads the tensors and settings its capture saw. :class:`Fingerprint`
is what a stage held then (modules, parameters, buffers), compared before
each run; :func:`signature` and :func:`autocast_key` are what a call passed
(argument shapes, dtypes, devices, plain values) and the autocast state it
ran under, parts of the key a call's graphs are found by.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..microbatch import leaves

__all__ = ["Fingerprint", "autocast_key", "signature"]


class Fingerprint:
    """What a stage's graphs baked in: its modules and their types, and each
    parameter and buffer (the object itself, its storage, dtype, shape,
    device, ``requires_grad`` and whether it has tensor hooks). Compared by
    identity, not ``id()``: an object freed and replaced may reuse the id.
    (Training modes are part of a call's key instead: a pipe switching
    between train and eval keeps the graphs of both.)"""

    __slots__ = ("objects", "meta")

    def __init__(self, stage: nn.Module) -> None:
        modules = list(stage.modules())
        tensors = [*stage.parameters(), *stage.buffers()]
        self.objects: list[object] = [*modules, *tensors]
        self.meta = tuple(type(m) for m in modules) + tuple(
            (t.data_ptr(), t.dtype, tuple(t.shape), t.device, t.requires_grad,
             bool(t._backward_hooks))
            for t in tensors
        )  # fmt: skip

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Fingerprint) or len(other.objects) != len(self.objects):
            return False
        same = all(a is b for a, b in zip(self.objects, other.objects))
        return same and self.meta == other.meta

    __hash__ = None  # type: ignore[assignment]


def autocast_key() -> tuple[Any, ...]:
    """The autocast state a capture bakes in: (device type, dtype) of each enabled one."""
    return tuple(
        (d, torch.get_autocast_dtype(d)) for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)
    )


def signature(args: Sequence[Any]) -> tuple[Any, ...] | None:
    """A call's arguments as a key: tensor metadata and plain values; None
    when a plain value cannot be a key (it is not hashable)."""
    items, spec = leaves(tuple(args))
    key: list[Any] = [spec]  # None, a flat tuple's marker, or a (hashable) TreeSpec
    for x in items:
        if isinstance(x, Tensor):
            key.append((x.dtype, tuple(x.shape), x.device, x.requires_grad))
        else:
            try:
                hash(x)
            except TypeError:
                return None
            key.append((type(x), x))
    return tuple(key)

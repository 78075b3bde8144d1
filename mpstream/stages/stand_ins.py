"""Copies standing in for a module's buffers and plain tensor attributes
while ``torch.fx`` traces it.

fx reads buffers as plain tensors, and a plain tensor attribute
(``self.calls = torch.zeros(())``, no buffer) as a constant, so a forward
that changes one (``self.steps += 1``) would change the real tensor once,
while tracing, and the change would be missing from the stages:
:func:`stand_ins` lets the trace change copies instead, and tells which it
changed (see :class:`~mpstream.stages.unrecorded.BufferChange`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

__all__ = ["Changed", "stand_ins"]


class Changed(NamedTuple):
    """A tensor of the module a trace changed.

    Attributes:
        name: its qualified name (``"blocks.0.calls"``).
        buffer: True for a registered buffer, False for a plain tensor
            attribute.
        assigned: True where forward put another tensor there, False
            where it changed the tensor in place.
    """

    name: str
    buffer: bool
    assigned: bool


@contextmanager
def stand_ins(module: nn.Module, buffers: bool = True) -> Iterator[Callable[[], list[Changed]]]:
    """While ``module`` is traced, a copy stands in for each of its buffers
    (unless ``buffers`` is False) and plain tensor attributes (a tensor held
    under several names gets one). fx reads them as plain tensors, so
    ``self.steps += 1`` in forward would change the real tensor once, while
    tracing, and leave the change out of the graph; so would
    ``torch.export`` for a plain tensor attribute. Yields what names those
    the trace changed (in place or by assignment)."""
    swapped: list[tuple[dict[str, Any], str, Tensor, Tensor, int, str, bool]] = []
    copies: dict[int, Tensor] = {}
    try:
        for owner, mod in module.named_modules():
            stores = [(mod._buffers, True)] if buffers else []
            for store, buffer in [*stores, (_plain_tensors(mod), False)]:
                for name, tensor in list(store.items()):
                    # A lazy module's buffer has no values to copy (clone raises),
                    # and fx never runs the module (a leaf), so nothing changes it.
                    if tensor is None or is_lazy(tensor):
                        continue
                    copy = copies.get(id(tensor))
                    if copy is None:
                        with torch.no_grad():
                            copy = tensor.clone().requires_grad_(tensor.requires_grad)
                        copies[id(tensor)] = copy
                    holder = mod._buffers if buffer else mod.__dict__
                    qualname = f"{owner}.{name}" if owner else name
                    swapped.append((holder, name, tensor, copy, copy._version, qualname, buffer))
                    holder[name] = copy

        def changed() -> list[Changed]:
            return [
                Changed(qualname, buffer, store.get(name) is not copy)
                for store, name, _, copy, version, qualname, buffer in swapped
                if store.get(name) is not copy or copy._version != version
            ]

        yield changed
    finally:
        for store, name, tensor, *_ in reversed(swapped):
            store[name] = tensor


def _plain_tensors(mod: nn.Module) -> dict[str, Tensor]:
    """``mod``'s tensor attributes that are neither parameters nor buffers
    (those live in their own dicts, not the instance's)."""
    return {
        k: v
        for k, v in vars(mod).items()
        if isinstance(v, Tensor) and not isinstance(v, nn.Parameter)
    }

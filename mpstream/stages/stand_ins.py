"""Copies standing in for a module's buffers while ``torch.fx`` traces it.

fx reads buffers as plain tensors, so a forward that changes one
(``self.steps += 1``) would change the real buffer once, while tracing,
and the change would be missing from the stages: :func:`stand_ins` lets
the trace change copies instead, and tells which it changed (see
:class:`~mpstream.stages.unrecorded.BufferChange`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

__all__ = ["stand_ins"]


@contextmanager
def stand_ins(module: nn.Module) -> Iterator[Callable[[], list[str]]]:
    """While ``module`` is traced, a copy stands in for each of its buffers
    (a tensor held under several names gets one). fx reads buffers as plain
    tensors, so ``self.steps += 1`` in forward would change the real buffer
    once, while tracing, and leave the change out of the graph. Yields what
    names the buffers the trace changed (in place or by assignment)."""
    swapped: list[tuple[dict[str, Any], str, Tensor, Tensor, int, str]] = []
    copies: dict[int, Tensor] = {}
    try:
        for owner, mod in module.named_modules():
            for name, tensor in list(mod._buffers.items()):
                # A lazy module's buffer has no values to copy (clone raises),
                # and fx never runs the module (a leaf), so nothing changes it.
                if tensor is None or is_lazy(tensor):
                    continue
                copy = copies.get(id(tensor))
                if copy is None:
                    with torch.no_grad():
                        copy = tensor.clone().requires_grad_(tensor.requires_grad)
                    copies[id(tensor)] = copy
                qualname = f"{owner}.{name}" if owner else name
                swapped.append((mod._buffers, name, tensor, copy, copy._version, qualname))
                mod._buffers[name] = copy

        def changed() -> list[str]:
            return [
                qualname
                for store, name, _, copy, version, qualname in swapped
                if store.get(name) is not copy or copy._version != version
            ]

        yield changed
    finally:
        for store, name, tensor, *_ in reversed(swapped):
            store[name] = tensor

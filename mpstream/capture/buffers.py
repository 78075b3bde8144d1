"""A captured step's static buffers: made from an example batch, filled per call.

A replay reads its inputs and targets from the tensors it was captured
with, so each call's batch is copied into those buffers, after checking
that it has the captured structure, shapes, dtypes and plain values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from ..runtime.microbatch import NoChunk
from .optimizer import same_plain

__all__ = ["fill", "static", "tensor"]


def static(leaf: Any, device: torch.device) -> Any:
    """A buffer of its own for a tensor leaf (NoChunk too); other leaves as they are."""
    if isinstance(leaf, NoChunk):
        return NoChunk(leaf.tensor.detach().to(device, copy=True))
    if isinstance(leaf, Tensor):
        return leaf.detach().to(device, copy=True)
    return leaf


def tensor(leaf: Any) -> Tensor | None:
    """A leaf's tensor (a NoChunk's too); None for a plain value."""
    if isinstance(leaf, NoChunk):
        return leaf.tensor
    return leaf if isinstance(leaf, Tensor) else None


def fill(what: str, static: list[Any], spec: Any, value: Any) -> None:
    """Copies ``value``'s tensors into the static buffers ``static`` (the
    leaves of a structure ``spec``), after checking all of them.

    Raises:
        ValueError: another structure, a plain value other than the
            captured one, or a tensor of another type, shape or dtype.
    """
    given, given_spec = pytree.tree_flatten(value)
    if given_spec != spec:
        raise ValueError(
            f"CapturedStep: {what} have another structure than the captured step's: "
            f"got {given_spec}, captured {spec}"
        )
    for i, (have, new) in enumerate(zip(static, given)):
        buffer, source = tensor(have), tensor(new)
        if buffer is None:
            if isinstance(new, (Tensor, NoChunk)) or not same_plain(have, new):
                raise ValueError(
                    f"CapturedStep: {what} leaf {i} is {new!r}; the step was captured "
                    f"with {have!r}, which the step keeps. Capture another step for it."
                )
            continue
        if source is None or isinstance(have, NoChunk) != isinstance(new, NoChunk):
            raise ValueError(
                f"CapturedStep: {what} leaf {i} is a {type(new).__name__}; the step "
                f"was captured with a {type(have).__name__}"
            )
        if source.shape != buffer.shape or source.dtype != buffer.dtype:
            raise ValueError(
                f"CapturedStep: {what} leaf {i} has shape {tuple(source.shape)} and "
                f"dtype {source.dtype}; the step was captured for "
                f"{tuple(buffer.shape)} and {buffer.dtype}. Shapes are fixed: capture "
                f"another step for this shape (sharing `pool`) or drop such batches "
                f"(DataLoader(drop_last=True))."
            )
    for have, new in zip(static, given):
        buffer, source = tensor(have), tensor(new)
        if buffer is not None and source is not None and source is not buffer:
            buffer.copy_(source.detach(), non_blocking=True)

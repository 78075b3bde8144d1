"""A pipeline call's inputs: positional, detached, sized, staged for transfer.

``Pipe.forward`` and ``Pipe.train_step`` turn the call's arguments into the
pipeline's positional inputs (a traced module binds them to its signature),
split them into micro-batches (:mod:`~mpstream.runtime.microbatch`) and, when they
sit in pageable host memory bound for a GPU, give each micro-batch a slice
of one pinned buffer per tensor (:mod:`~mpstream.runtime.transfer`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ..runtime.microbatch import PLAIN, NoChunk, describe, leaves, split
from ..runtime.transfer import host_staging

__all__ = ["positional", "check_holds_tensor", "staging", "detached", "micro_sizes", "keywords_of"]


def positional(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """A Sequential pipeline's positional inputs for a call: positional
    arguments only (a list is the batch as a tuple of tensors, torchgpipe's
    style). A traced module binds a call itself (see :mod:`~mpstream.stages.kinds`).

    Raises:
        TypeError: keyword arguments, no input, or only plain values (a
            string, a list of numbers, ...), no tensor.
    """
    if kwargs:
        names = ", ".join(sorted(kwargs))
        raise TypeError(
            f"a Pipe over an nn.Sequential takes positional inputs only; got keyword "
            f"argument(s) {names}"
        )
    if not args:
        raise TypeError("Pipe needs at least one input")
    check_holds_tensor(args, kwargs)
    return tuple(tuple(a) if isinstance(a, list) else a for a in args)


def check_holds_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuses a call that holds only plain values, no tensor to split.

    Raises:
        TypeError: naming what was passed and what to do.
    """
    # Checked before a list becomes a tuple, so the message shows what the
    # caller passed; other leaves (arrays, ...) get scatter's message. A
    # tensor argument, the usual call, skips the flattening.
    if not any(type(a) is Tensor for a in args) and all(
        isinstance(leaf, PLAIN) for leaf in pytree.tree_leaves((args, kwargs))
    ):
        given = args[0] if len(args) == 1 and not kwargs else (*args, *kwargs.values())
        raise TypeError(
            f"Pipe input holds no tensor; got {describe(given)}. Pass the batch as a Tensor "
            f"(torch.as_tensor converts numbers, lists and arrays), or a tuple, list or dict "
            f"holding tensors"
        )


def staging(
    value: Any, device: torch.device, chunks: int | None, split_size: int | None
) -> list[tuple[Tensor | None, ...] | None] | None:
    """Per micro-batch, pinned buffers for ``value``'s pageable tensors
    (aligned with its leaves), split as the batch is; None if none needed."""
    buffers = host_staging(value, device)
    if buffers is None:
        return None
    parts = [None if b is None else split(b, chunks, split_size) for b in buffers]
    micros = max(len(p) for p in parts if p is not None)
    out: list[tuple[Tensor | None, ...] | None] = [
        tuple(None if p is None else p[i] for p in parts) for i in range(micros)
    ]
    return out


def detached(value: Any) -> Any:
    """``value`` with every tensor detached, :class:`NoChunk` ones included."""

    def detach(leaf: Any) -> Any:
        if isinstance(leaf, Tensor):
            return leaf.detach()
        return NoChunk(leaf.tensor.detach()) if isinstance(leaf, NoChunk) else leaf

    return pytree.tree_map(detach, value)


def micro_sizes(value: Any, chunks: int | None, split_size: int | None) -> list[int]:
    """The batch size of each micro-batch ``value`` splits into: that of its
    tensors, split along dim 0 (:class:`NoChunk` tensors are not split).

    Raises:
        TypeError: it holds no tensor to split.
    """
    for leaf in leaves(value)[0]:
        if isinstance(leaf, Tensor):
            return [len(part) for part in split(leaf, chunks, split_size)]
    raise TypeError("the batch holds no tensor to split")


def keywords_of(root: nn.Module, inputs: Mapping[Any, Any]) -> bool:
    """Whether ``inputs`` is ``root.forward``'s keyword arguments rather than
    one input: its keys are strings and one at least names a parameter (a
    key ``forward`` does not take is then refused by name, or goes to its
    ``**kwargs``: a Hugging Face batch's extra keys)."""
    try:
        params = inspect.signature(root.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = {p.name for p in params if p.kind in keyword}
    keys = list(inputs)
    return all(isinstance(k, str) for k in keys) and any(k in named for k in keys)

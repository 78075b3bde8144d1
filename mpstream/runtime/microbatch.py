"""Micro-batch scatter over any structure of values.

A pipeline's inputs, the values stages pass on and its outputs are nested
tuples, lists and dicts (PyTorch's pytrees) whose leaves are tensors or plain
values (int, float, bool, str, None, ...). Scatter splits every tensor leaf
along dim 0 (by count like ``torch.chunk`` or by size like ``torch.split``)
and gives every micro-batch the plain leaves and :class:`NoChunk` tensors
whole, validating and saying exactly what is wrong; the leaf helpers here
take such structures apart and put them together again. The way back
(joining the micro-batches' outputs) is :mod:`~mpstream.runtime.gathering`.
"""

from __future__ import annotations

import operator
import reprlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .rebuilds import check_rebuilds

__all__ = [
    "Value",
    "NoChunk",
    "PLAIN",
    "as_value",
    "batch_device",
    "scatter",
    "scatter_sized",
    "split",
    "describe",
    "leaves",
    "FLAT",
    "tensors_of",
    "gradless",
    "grad_dtype",
    "rebuild",
    "untensored",
    "placed",
]

# What flows between the stages of a chain: one tensor, or a tuple of them
# (any pytree in general; this alias names the common case).
Value = Tensor | tuple[Tensor, ...]

# Leaves that are not tensors but may flow between stages and out.
PLAIN = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)


class NoChunk:
    """An input tensor that is not split: every micro-batch gets it whole.

    Args:
        tensor: the tensor (a mask, an embedding table, ...).

    Raises:
        TypeError: ``tensor`` is not a Tensor.
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"NoChunk wraps a Tensor, got {type(tensor).__name__}")
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"NoChunk({tuple(self.tensor.shape)})"


#: The structure :func:`leaves` gives a flat tuple of ``n`` tensors is
#: ``(FLAT, n)`` (the common case, kept off pytree's slower path; built
#: inline, not by a helper: once per replayed task).
FLAT = "flat tuple"


def leaves(value: Any) -> tuple[list[Any], Any]:
    """The leaves of ``value`` and its structure (None: ``value`` is a Tensor)."""
    if type(value) is Tensor:
        return [value], None
    if type(value) is tuple:
        for v in value:  # a loop, not all(): its generator is a call per item
            if type(v) is not Tensor:
                break
        else:
            return list(value), (FLAT, len(value))
    return pytree.tree_flatten(value)


def grad_dtype(t: Tensor) -> bool:
    """Whether ``t``'s dtype has gradients (floating point or complex)."""
    return t.is_floating_point() or t.is_complex()


def gradless(inputs: Sequence[Tensor], outputs: Sequence[Tensor]) -> list[Tensor]:
    """The outputs of an identity-like autograd function that carry no
    gradient: those whose input needs none (a constant stays one), and those
    of a dtype without gradients (integers, bool; complex ones have them)."""
    return [y for x, y in zip(inputs, outputs) if not (x.requires_grad and grad_dtype(y))]


def rebuild_leaves(items: Sequence[Any], spec: Any) -> Any:
    """The inverse of :func:`leaves`."""
    if spec is None:
        return items[0]
    if type(spec) is tuple:
        return tuple(items)
    return pytree.tree_unflatten(list(items), spec)


def untensored(items: Sequence[Any]) -> list[Any]:
    """Leaves ``items`` with None where a tensor was: what a structure keeps
    of them to be filled again (:func:`placed`), holding no tensor alive."""
    return [None if isinstance(x, Tensor) else x for x in items]


def placed(items: Sequence[Any], where: Sequence[int], spec: Any, tensors: Sequence[Any]) -> Any:
    """The structure ``spec`` (of :func:`leaves`) of leaves ``items``, with
    ``tensors`` put at positions ``where``."""
    out = list(items)
    for i, t in zip(where, tensors):
        out[i] = t
    return rebuild_leaves(out, spec)


def tensors_of(value: Value) -> tuple[Tensor, ...]:
    """The tensors of a Tensor-or-tuple value, as a tuple."""
    return (value,) if isinstance(value, Tensor) else value


def rebuild(value: Value, tensors: Sequence[Tensor]) -> Value:
    """``tensors`` shaped like ``value``: one tensor, or a tuple."""
    return tensors[0] if isinstance(value, Tensor) else tuple(tensors)


def describe(value: Any) -> str:
    """``value`` for an error message: its type, what a list, tuple or dict
    holds, and its start, e.g. ``list of float: [1.0, 2.0]``."""
    kind = type(value).__name__
    if isinstance(value, (list, tuple, dict)) and value:
        items = value.values() if isinstance(value, dict) else value
        kind += " of " + " and ".join(sorted({type(v).__name__ for v in items}))
    # reprlib shortens long strings and containers without building their whole repr.
    return f"{kind}: {reprlib.repr(value)}"


def as_value(x: object, what: str = "input") -> Value:
    """Validates a Tensor-or-tuple batch and normalises a list to a tuple.

    Raises:
        TypeError: ``x`` is not a Tensor or a tuple/list of Tensors.
        ValueError: a tensor has no batch dimension, the batch is empty, or
            the tensors disagree on the batch size.
    """
    if isinstance(x, Tensor):
        tensors: tuple[Tensor, ...] = (x,)
        value: Value = x
    elif isinstance(x, (tuple, list)):
        if not x:
            raise ValueError(f"{what} is an empty {type(x).__name__}; expected tensors")
        for i, t in enumerate(x):
            if not isinstance(t, Tensor):
                raise TypeError(
                    f"{what}[{i}] is {type(t).__name__}; mpstream takes a Tensor or a "
                    f"tuple/list of Tensors"
                )
        tensors = tuple(x)
        value = tensors
    else:
        raise TypeError(
            f"{what} is {type(x).__name__}; mpstream takes a Tensor or a tuple/list of Tensors"
        )
    sizes = set()
    for i, t in enumerate(tensors):
        if t.dim() == 0:
            raise ValueError(f"{what} tensor {i} is a scalar; it needs a batch dimension (dim 0)")
        sizes.add(t.size(0))
    if len(sizes) > 1:
        raise ValueError(f"{what} tensors disagree on the batch size (dim 0): {sorted(sizes)}")
    if sizes == {0}:
        raise ValueError(f"{what} is an empty batch (size 0 along dim 0)")
    return value


def batch_device(value: Any) -> torch.device:
    """The device all split tensors of ``value`` sit on (``NoChunk`` included).

    Raises:
        ValueError: the tensors sit on different devices, or there is none.
    """
    devices = set()
    for leaf in leaves(value)[0]:
        if isinstance(leaf, NoChunk):
            leaf = leaf.tensor
        if isinstance(leaf, Tensor):
            devices.add(leaf.device)
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"input tensors sit on several devices ({names}); put them on one")
    if not devices:
        raise ValueError("the input holds no tensor")
    return devices.pop()


def split(t: Tensor, chunks: int | None, split_size: int | None) -> tuple[Tensor, ...]:
    """One tensor's micro-batches, as :func:`scatter` splits every tensor."""
    if split_size is not None:
        return torch.split(t, split_size, dim=0)
    if chunks is None or chunks == 1:
        return (t,)
    return t.chunk(chunks, dim=0)


def scatter(
    value: Any, chunks: int | None, split_size: int | None, what: str = "input"
) -> list[Any]:
    """The micro-batches of ``value``: :func:`scatter_sized`'s first item
    (same arguments and errors), for callers that need not their sizes."""
    return scatter_sized(value, chunks, split_size, what)[0]


def scatter_sized(
    value: Any, chunks: int | None, split_size: int | None, what: str = "input"
) -> tuple[list[Any], list[int]]:
    """Splits ``value`` into micro-batches and says their batch sizes, which
    the micro-batches alone may not tell (a :class:`NoChunk` tensor comes out
    of the split as a plain tensor).

    Args:
        value: any structure of tensors, :class:`NoChunk` and plain values
            (the tuple of a pipeline's arguments, say).
        chunks: number of micro-batches, as ``torch.chunk``: at most
            that many, of ``ceil(batch / chunks)`` rows (the last may be
            smaller), so fewer where that size covers the batch sooner
            (3 for a batch of 6 and ``chunks=4``).
        split_size: micro-batch size, as ``torch.split``. Exactly one of
            ``chunks`` and ``split_size`` is given, or neither (one chunk).
        what: how errors name ``value``.

    Returns:
        The micro-batches, each structured like ``value``, and their sizes
        (those of the first tensor split).

    Raises:
        TypeError: ``value`` holds no tensor to split, or a leaf that is
            neither a tensor, ``NoChunk`` nor a plain value.
        ValueError: a tensor to split is a scalar or empty, or tensors to
            split into several micro-batches differ in batch size.
    """
    items, spec = leaves(value)
    parts: list[tuple[Tensor, ...] | None] = []
    for i, leaf in enumerate(items):
        if isinstance(leaf, Tensor):
            if leaf.dim() == 0:
                raise ValueError(
                    f"{what} tensor {i} is a scalar; it needs a batch dimension (dim 0), or "
                    f"wrap it in mpstream.NoChunk to give it whole to every micro-batch"
                )
            if leaf.size(0) == 0:
                raise ValueError(f"{what} is an empty batch (size 0 along dim 0)")
            parts.append(split(leaf, chunks, split_size))
        elif isinstance(leaf, NoChunk) or isinstance(leaf, PLAIN):
            parts.append(None)
        else:
            raise TypeError(
                f"{what} holds a {type(leaf).__name__}; mpstream splits tensors and passes "
                f"plain values (int, float, bool, str, None) and NoChunk tensors to every "
                f"micro-batch"
            )
    counts = {len(p) for p in parts if p is not None}
    if not counts:
        if any(isinstance(leaf, NoChunk) for leaf in items):
            raise TypeError(
                f"{what}: every tensor is wrapped in mpstream.NoChunk (given whole to every "
                f"micro-batch), so none defines the micro-batches; leave at least one "
                f"batch tensor unwrapped"
            )
        raise TypeError(
            f"{what} holds no tensor to split into micro-batches; got {describe(value)}. "
            f"Pass a Tensor (torch.as_tensor converts numbers, lists and arrays), or a "
            f"tuple, list or dict holding tensors"
        )
    # Equal batch sizes, not only equal counts: rows 0-2 of one tensor must
    # meet rows 0-2 of the other, as in the whole batch (one micro-batch is
    # the batch as given).
    sizes = sorted({t.size(0) for t in items if isinstance(t, Tensor)})
    if len(sizes) > 1 and max(counts) > 1:
        raise ValueError(
            f"{what} tensors have different batch sizes (dim 0): {sizes}; mpstream splits "
            f"every tensor along dim 0 into micro-batches. Give them the same batch size, "
            f"or wrap those not to split in mpstream.NoChunk"
        )
    (micros,) = counts
    check_rebuilds(value, what, items, spec)
    # The first split tensor's: a NoChunk one comes out of the split whole.
    # map and methodcaller, not a comprehension (a Python call before 3.12):
    # pipe(x) gains no call from saying the sizes.
    sizes = list(map(operator.methodcaller("size", 0), next(filter(None, parts))))
    # The common cases without a rebuild per micro-batch: one tensor (its
    # chunks), a flat tuple of tensors (the tuples of their chunks).
    if spec is None:
        chunked = parts[0]
        assert chunked is not None
        return list(chunked), sizes
    if type(spec) is tuple:
        return list(zip(*parts)), sizes  # every part is a tensor's
    rebuilt = [
        rebuild_leaves(
            [
                p[m] if p is not None else (leaf.tensor if isinstance(leaf, NoChunk) else leaf)
                for p, leaf in zip(parts, items)
            ],
            spec,
        )
        for m in range(micros)
    ]
    return rebuilt, sizes

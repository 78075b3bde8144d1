"""Micro-batch scatter and gather.

A batch is a Tensor or a tuple of Tensors whose first dimension is the batch.
Scatter splits it into micro-batches (by count like ``torch.chunk`` or by size
like ``torch.split``); gather concatenates per-micro-batch outputs back along
dim 0. Both validate their input and say exactly what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "Value",
    "as_value",
    "batch_device",
    "scatter",
    "split",
    "gather",
    "check_output",
    "tensors_of",
    "rebuild",
]

# What flows between stages: one tensor, or a tuple of tensors.
Value = Tensor | tuple[Tensor, ...]


def tensors_of(value: Value) -> tuple[Tensor, ...]:
    """The tensors of a value, as a tuple."""
    return (value,) if isinstance(value, Tensor) else value


def rebuild(value: Value, tensors: Sequence[Tensor]) -> Value:
    """``tensors`` shaped like ``value``: one tensor, or a tuple."""
    return tensors[0] if isinstance(value, Tensor) else tuple(tensors)


def as_value(x: object, what: str = "input") -> Value:
    """Validates a pipeline input and normalises a list to a tuple.

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


def batch_device(value: Value) -> torch.device:
    """The device all tensors of ``value`` sit on.

    Raises:
        ValueError: the tensors sit on different devices.
    """
    tensors = (value,) if isinstance(value, Tensor) else value
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"input tensors sit on several devices ({names}); put them on one")
    return tensors[0].device


def scatter(value: Value, chunks: int | None, split_size: int | None) -> list[Value]:
    """Splits ``value`` into micro-batches along dim 0.

    Args:
        value: a validated batch (see :func:`as_value`).
        chunks: number of micro-batches, as ``torch.chunk`` (fewer when the
            batch is smaller; the last may be smaller).
        split_size: micro-batch size, as ``torch.split``. Exactly one of
            ``chunks`` and ``split_size`` is given, or neither (one chunk).

    Returns:
        The micro-batches, each a Tensor or tuple like ``value``.
    """

    if isinstance(value, Tensor):
        return list(split(value, chunks, split_size))
    parts = [split(t, chunks, split_size) for t in value]
    return [tuple(p[i] for p in parts) for i in range(len(parts[0]))]


def split(t: Tensor, chunks: int | None, split_size: int | None) -> tuple[Tensor, ...]:
    """One tensor's micro-batches, as :func:`scatter` splits every tensor."""
    if split_size is not None:
        return torch.split(t, split_size, dim=0)
    if chunks is None or chunks == 1:
        return (t,)
    return t.chunk(chunks, dim=0)


def check_output(out: object, stage: int) -> Value:
    """Validates what a stage returned.

    Raises:
        TypeError: naming the stage, when ``out`` is not a Tensor or a tuple
            of Tensors.
    """
    if isinstance(out, Tensor):
        return out
    if isinstance(out, tuple) and out and all(isinstance(t, Tensor) for t in out):
        return out
    if isinstance(out, tuple):
        kinds = ", ".join(type(t).__name__ for t in out) or "empty"
        detail = f"a tuple of ({kinds})"
    else:
        detail = type(out).__name__
    raise TypeError(
        f"stage {stage} returned {detail}; a stage must return a Tensor or a tuple of Tensors"
    )


def gather(outputs: Sequence[Value]) -> Value:
    """Concatenates per-micro-batch outputs along dim 0.

    Raises:
        ValueError: the micro-batches returned different structures, or a
            scalar output that cannot be concatenated.
    """
    first = outputs[0]
    if isinstance(first, Tensor):
        if any(not isinstance(o, Tensor) for o in outputs):
            raise ValueError("the last stage returned a Tensor for some micro-batches only")
        tensors = [o for o in outputs if isinstance(o, Tensor)]
        return _cat(tensors, "output")
    width = len(first)
    if any(isinstance(o, Tensor) or len(o) != width for o in outputs):
        raise ValueError("the last stage returned differently shaped tuples across micro-batches")
    columns = zip(*[o for o in outputs if not isinstance(o, Tensor)])
    return tuple(_cat(list(col), f"output[{i}]") for i, col in enumerate(columns))


def _cat(tensors: list[Tensor], what: str) -> Tensor:
    if len(tensors) == 1:
        return tensors[0]
    if tensors[0].dim() == 0:
        raise ValueError(
            f"{what} is a scalar per micro-batch and cannot be concatenated along dim 0; "
            f"return batched tensors from the last stage"
        )
    return torch.cat(tensors, dim=0)

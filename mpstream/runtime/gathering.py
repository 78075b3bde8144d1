"""Micro-batches' outputs joined into the batch's, and what a stage returns
checked.

A stage returns tensors and plain values in nested tuples, lists and dicts
(PyTorch's pytrees). :func:`gather` concatenates the micro-batches' tensor
leaves back along dim 0, the inverse of :func:`~mpstream.runtime.microbatch.scatter`,
and lists the plain ones per micro-batch; :func:`check_output` refuses any
other leaf. Both say exactly what is wrong, and where in the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .microbatch import PLAIN, describe, leaves, rebuild_leaves
from .output_paths import output_name, structure_difference
from .rebuilds import check_rebuilds

__all__ = ["check_output", "gather"]


def check_output(out: Any, stage: int) -> Any:
    """Validates what a stage returned: tensors and plain values in any structure.

    Raises:
        TypeError: naming the stage and the offending value's type.
    """
    if type(out) is Tensor:
        return out
    for leaf in leaves(out)[0]:
        if not isinstance(leaf, (Tensor, *PLAIN)):
            raise TypeError(
                f"stage {stage} returned a {type(leaf).__name__}; values between stages are "
                f"tensors, plain values (int, float, bool, str, None) and tuples, lists and "
                f"dicts of them"
            )
    return out


def gather(outputs: Sequence[Any]) -> Any:
    """Joins per-micro-batch outputs: tensors along dim 0, plain values in lists.

    Raises:
        ValueError: the micro-batches returned different structures, or a
            scalar tensor that cannot be concatenated (named by its path in
            the output, see :func:`output_name`).
    """
    flat = [leaves(out) for out in outputs]
    first, spec = flat[0]
    if any(other != spec for _, other in flat[1:]):
        # Either the structures differ, or a flat tuple of tensors (which
        # leaves() gives a spec of its own) meets one holding a plain
        # value, (y, z) and (y, None): pytree's structures tell which.
        for m, out in enumerate(outputs[1:], 1):
            where = structure_difference(outputs[0], out, m)
            if where is not None:
                raise ValueError(
                    f"the last stage returned values of different structures across "
                    f"micro-batches: {where}. Return the same structure (containers, keys, "
                    f"lengths) for every micro-batch; plain values may differ, and a tensor "
                    f"in one micro-batch's output needs a tensor in every one's"
                )
        flat = [pytree.tree_flatten(out) for out in outputs]
        first, spec = flat[0]
    check_rebuilds(outputs[0], "the pipeline's output", *flat[0])
    columns: list[list[Any]] = [[leaf] for leaf in first]
    for items, _ in flat[1:]:
        for column, leaf in zip(columns, items):
            column.append(leaf)
    joined: list[Any] = []
    for i, column in enumerate(columns):
        tensors = [leaf for leaf in column if isinstance(leaf, Tensor)]
        if not tensors:
            joined.append(column)
        elif len(tensors) != len(column):
            plain = next(m for m, leaf in enumerate(column) if not isinstance(leaf, Tensor))
            tensor = next(m for m, leaf in enumerate(column) if isinstance(leaf, Tensor))
            raise ValueError(
                f"{output_name(outputs[0], i)} is a tensor for some micro-batches only "
                f"(micro-batch {tensor}: shape {tuple(column[tensor].shape)}, micro-batch "
                f"{plain}: {describe(column[plain])}); return a tensor there for every "
                f"micro-batch"
            )
        elif len(tensors) > 1 and tensors[0].dim() == 0:
            raise ValueError(
                f"{output_name(outputs[0], i)} is a scalar per micro-batch: one value for "
                f"each micro-batch's rows, which do not join along dim 0 into the batch's. "
                f"Return it per sample (dim 0 the batch, as a loss with reduction='none' "
                f"gives), or compute and reduce it after the pipe from the batched outputs"
            )
        else:
            joined.append(tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0))
    return rebuild_leaves(joined, spec)

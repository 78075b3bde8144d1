"""What a captured call's backward computes: all of it, or B and W apart.

A call that needs gradients differentiates its outputs, from the static
output gradients, with respect to its inputs and the stage's parameters.
Where the schedule splits the backward, :func:`input_pass` (B) stops at
the inputs, keeping the gradients that flow into the junctions of
:class:`~mpstream.runtime.split_backward.Split`, and :func:`weight_pass` (W)
starts from them toward the parameters. The backends run these functions
eagerly (warm-up, emulation) or under capture, so what a replay computes is
what ran here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..split_backward import Split
from .call import GraphedCall

__all__ = [
    "b_targets",
    "differentiate",
    "eager_backward",
    "input_pass",
    "merge",
    "set_passes",
    "split_of",
    "store_grads",
    "weight_pass",
]


def differentiate(call: GraphedCall, outputs: Sequence[Tensor]) -> tuple[Tensor | None, ...]:
    """The gradients of the call's differentiable outputs, from the static
    output gradients, with respect to its inputs and parameters."""
    roots = [outputs[k] for k in call.diff_out]
    return torch.autograd.grad(roots, call.grad_targets(), call.static_grad_out, allow_unused=True)


def store_grads(call: GraphedCall, grads: Sequence[Tensor | None]) -> None:
    n = sum(1 for t in call.static_in if t.requires_grad)
    call.static_grad_in = list(grads[:n])
    call.static_grad_params = list(grads[n:])


def split_of(call: GraphedCall, outputs: Sequence[Tensor]) -> Split:
    """The call's backward cut inside it: its static inputs are B's sinks."""
    mine = {id(t) for t in call.static_in if t.requires_grad}
    roots = [outputs[k] for k in call.diff_out]
    return Split(roots, call.static_grad_out, lambda n: id(getattr(n, "variable", None)) in mine)


def b_targets(call: GraphedCall, split: Split) -> list[Tensor]:
    """What B differentiates: the inputs needing gradients, and the
    parameters B keeps."""
    ins = [t for t in call.static_in if t.requires_grad]
    if not (split.whole or split.reaches):
        return []
    kept = {id(p) for p in (call.params if split.whole else split.eager)}
    return ins + [p for p in call.params if id(p) in kept]


def input_pass(call: GraphedCall, outputs: Sequence[Tensor], split: Split) -> list[Any]:
    """B inside the call: the input gradients, then per parameter its
    gradient if B computes it (None where W does)."""
    targets = b_targets(call, split)
    n = sum(1 for t in call.static_in if t.requires_grad)
    if not targets:  # the outputs reach no input: nothing for B
        return [None] * (n + len(call.params))
    roots = [outputs[k] for k in call.diff_out]
    with split.keeping():
        got = torch.autograd.grad(
            roots, targets, call.static_grad_out, retain_graph=True, allow_unused=True
        )
    by_id = {id(t): g for t, g in zip(targets[n:], got[n:])}
    return [*got[:n], *(by_id.get(id(p)) for p in call.params)]


def weight_pass(call: GraphedCall, split: Split) -> list[Tensor | None]:
    """W inside the call: the parameter gradients B left, per parameter."""
    got: dict[int, Tensor | None] = {}
    with split.pinned():
        for edges, values, params in split.groups():
            grads = torch.autograd.grad(edges, params, values, allow_unused=True)  # type: ignore[arg-type]
            got.update((id(p), g) for p, g in zip(params, grads))
    return [got.get(id(p)) for p in call.params]


def set_passes(call: GraphedCall, split: Split) -> None:
    """Which passes a split call has: B where it differentiates something,
    W where B leaves it work."""
    call.weighs_later = split.defers
    b = ("backward",) if b_targets(call, split) else ()
    call.passes = ("forward", *b, *(("weight",) if split.defers else ()))


def merge(call: GraphedCall, first: Sequence[Any], second: Sequence[Any]) -> list[Any]:
    """B's gradients, with W's for the parameters B left."""
    n = len(first) - len(call.params)
    return [*first[:n], *(a if a is not None else b for a, b in zip(first[n:], second))]


def eager_backward(call: GraphedCall, outputs: Sequence[Tensor]) -> list[Any]:
    """The call's backward run eagerly, split as its graphs will be."""
    if not call.split:
        call.passes = ("forward", "backward")
        return list(differentiate(call, outputs))
    split = split_of(call, outputs)
    set_passes(call, split)
    first = input_pass(call, outputs, split)
    return merge(call, first, weight_pass(call, split)) if split.defers else first

"""Where a split backward's W starts: B's kept gradients, and tensor hooks.

W (see :mod:`~mpstream.runtime.split_backward`) starts autograd at each
junction's output. Autograd runs that output's tensor hooks on the gradient
given there, then ``retain_grad``'s, then the node's prehooks, and gives
Python no way to skip the hooks, which already ran in B on the real
gradient. So W gives them zeros (one element in memory: no allocation or
memset per junction); a hook of ours, after theirs, turns anything else
they return (``g + 1``) into zeros, which a retained ``.grad`` adds; and a
node prehook hands the junction what B kept. A hook's other effects (a
count, a log) happen in W too, on zeros. A hook writing in place into the
zeros fails there where torch refuses the write (``g.clamp_``):
:func:`pinned` adds a note saying what to do; where torch makes it
(``g.masked_fill_``), into every start's one element, the changed zeros
are dropped as any other result.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from . import private
from .errors import annotate

__all__ = ["Group", "pinned", "zeros_like"]

#: A W call: where it starts, the gradients flowing in there, and the
#: parameters it differentiates.
Group = tuple[list[GradientEdge], list[Tensor], list[Tensor]]

# What torch says when a hook writes in place into W's zeros (one element).
_SHARED_ELEMENT = "more than one element of the written-to tensor refers to a single memory"
_IN_PLACE_HOOK = (
    "mpstream: a tensor hook that changes its gradient in place (g.clamp_(...), g.mul_(...)) "
    "on the output of a layer whose weight gradient the zero-bubble weight pass (W) computes "
    "runs again in W, given zeros held in one element, which it cannot write into. Make the "
    "hook return a new tensor (return g.clamp(...)), or use a schedule without a weight "
    "pass (gpipe, 1f1b)"
)


@contextmanager
def pinned(kept: dict[Node, list[Any]], groups: Sequence[Group]) -> Iterator[None]:
    """Around the autograd calls of W's ``groups``: each junction starts from
    the gradients B ``kept`` there, and the tensor hooks there change nothing
    (see the module's notes).

    Raises:
        RuntimeError: as autograd raised it; one from a hook writing in
            place into W's zeros gets a note saying what to do.
    """
    # W's zeros by id, with their version: a hook may write into them in
    # place where torch lets it (g[0] = 1, g.fill_(1)), changing them all.
    starts = {id(g): g._version for _, grads, _ in groups for g in grads}
    handles: list[Any] = []
    after: dict[int, Tensor] = {}  # per output index, a tensor lending its hook dict
    try:
        for node, values in kept.items():

            def pin(grad_outputs: tuple[Any, ...], values: list[Any] = values) -> tuple[Any, ...]:
                return tuple(g if v is None else v for g, v in zip(grad_outputs, values))

            handles.append(node.register_prehook(pin))
            for i, v in enumerate(values):
                if v is not None:
                    if i not in after:
                        after[i], handle = _zeroing(i, starts)
                        handles.append(handle)
                    private.register_hook_dict(node, after[i])
        yield
    except RuntimeError as exc:
        if _SHARED_ELEMENT in str(exc):
            annotate(exc, _IN_PLACE_HOOK)
        raise
    finally:
        # Torch gives no way to take a hook dict off a node; emptied, the
        # dict leaves the nodes W freed a hook that does nothing.
        for h in handles:
            h.remove()


def _zeroing(index: int, starts: dict[int, int]) -> tuple[Tensor, Any]:
    """An empty tensor that is output ``index`` of its node and whose hook
    turns a gradient other than W's zeros (``starts``: by id, unchanged
    since their version) into zeros:
    lent to another node, its hook dict runs at that node's output
    ``index``. Returns it and the handle that empties the dict."""
    with torch.enable_grad():
        base = torch.empty(0, index + 1, requires_grad=True)
        # A leaf is output 0; unbind's outputs are numbered (and cost more).
        stand_in = base if index == 0 else base.unbind(1)[index]

    def no_gradient(g: Tensor) -> Tensor | None:
        # The common case (no hook, or one returning None): W's own zeros.
        return None if starts.get(id(g)) == g._version else zeros_like(g)

    handle = stand_in.register_hook(no_gradient)  # type: ignore[no-untyped-call]
    return stand_in, handle


def zeros_like(g: Tensor) -> Tensor:
    """Zeros shaped like ``g``, one element in memory where the layout allows."""
    if g.layout is not torch.strided:
        return torch.zeros_like(g)
    return g.new_zeros(()).expand_as(g)

"""Where a split backward's W starts: B's kept gradients, and tensor hooks.

W (see :mod:`~mpstream.runtime.split_backward`) starts autograd at each
junction's output. Autograd runs a node's tensor hooks there
(``Tensor.register_hook``'s, on any of its outputs), on the gradient given,
then ``retain_grad``'s, then the node's prehooks. The tensor hooks already
ran in B, on the real gradient (B ran the node, for every output), and a
plain backward runs them once. Python gives no way to take them off a
node, so the extension does (``mpstream._C.MutedHooks``): while W's
autograd calls run, each junction's tensor hooks are set aside, and they
are given back after (after a failure too), ahead of any hook registered
meanwhile. Whoever registered them, and whenever: a hook registered in a
forward run by hand, or by code holding torch's ``register_hook`` from
before, is muted too, and nothing of torch's is replaced.

What W still runs again there: hooks on the node itself
(``grad_fn.register_prehook``, ``grad_fn.register_hook``, and the
deprecated ``Module.register_backward_hook``, which is one), which stay on
the node; W's own prehook is one.

A junction's node belongs to one micro-batch, and a step's autograd calls
run on its host thread one after another (a call waits for autograd's
device threads), so no B, nor another micro-batch's W, finds a node W
muted. Only another thread back-propagating through the same nodes could,
which a step's graph never shares.

W gives the junctions zeros (one element in memory: no allocation or
memset per junction), which a retained ``.grad`` adds (``retain_grad``'s
hook is kept apart from the tensor hooks, and runs), and a node prehook
hands the junction what B kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, cast

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from .. import _ext

__all__ = ["Group", "MutedHooks", "mute", "pinned", "zeros_like"]

#: A W call: where it starts, the gradients flowing in there, and the
#: parameters it differentiates.
Group = tuple[list[GradientEdge], list[Tensor], list[Tensor]]

_C = _ext.load()


class MutedHooks(Protocol):
    """A node's tensor hooks, set aside (``mpstream._C.MutedHooks``)."""

    def restore(self) -> None:
        """Gives the node its hooks back, ahead of any it gained meanwhile;
        once (later calls do nothing, as does the object's end)."""

    def __len__(self) -> int:
        """How many hooks are set aside (0 once restored)."""


def mute(node: Node) -> MutedHooks:
    """Takes the tensor hooks off ``node`` (those ``Tensor.register_hook``
    put there, for each of its outputs) until the result's ``restore()``.
    ``retain_grad``'s hooks and the node's own prehooks and posthooks stay.

    Args:
        node: an autograd node (a tensor's ``grad_fn``, a
            :class:`~torch.autograd.graph.GradientEdge`'s ``node``), of a
            built-in operator or a custom ``autograd.Function``.

    Returns:
        What gives them back; the node lives until then.

    Raises:
        TypeError: ``node`` is not an autograd node.
        ValueError: the node was freed (its graph released).
    """
    return cast(MutedHooks, _C.MutedHooks(node))


@contextmanager
def pinned(kept: dict[Node, list[Any]]) -> Iterator[None]:
    """Around W's autograd calls: each junction starts from the gradients B
    ``kept`` there, and its tensor hooks do not run (see the module's
    notes).

    Raises:
        RuntimeError: as autograd raised it; the hooks are back in place.
    """
    handles: list[Any] = []
    muted: list[MutedHooks] = []
    try:
        for node, values in kept.items():

            def pin(grad_outputs: tuple[Any, ...], values: list[Any] = values) -> tuple[Any, ...]:
                return tuple(g if v is None else v for g, v in zip(grad_outputs, values))

            handles.append(node.register_prehook(pin))
            muted.append(mute(node))
        yield
    finally:
        for h in handles:
            h.remove()
        for m in muted:
            m.restore()


def zeros_like(g: Tensor) -> Tensor:
    """Zeros shaped like ``g``, one element in memory where the layout allows."""
    if g.layout is not torch.strided:
        return torch.zeros_like(g)
    return g.new_zeros(()).expand_as(g)

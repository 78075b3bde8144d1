"""Where a split backward's W starts: B's kept gradients, and the hooks there.

W (see :mod:`~mpstream.runtime.split_backward`) starts autograd at each
junction's output, and so runs the junction's node again. Autograd runs a
node's tensor hooks there (``Tensor.register_hook``'s, on any of its
outputs), on the gradient given, then ``retain_grad``'s, then the node's
prehooks (``Node.register_prehook``'s), then the node, then its posthooks
(``Node.register_hook``'s, and the deprecated
``Module.register_backward_hook``'s, which is one). All of them already ran
in B, on the real gradients (B ran the node, for every output), and a plain
backward runs them once. Python gives no way to take them off a node, so
the extension does (``mpstream._C.MutedHooks``): while W's autograd calls
run, each junction's tensor hooks, prehooks and posthooks are set aside,
and they are given back after (after a failure too), each kind ahead of
any hook registered meanwhile. Whoever registered them, and whenever: a
hook registered in a forward run by hand, or by code holding torch's
``register_hook`` from before, is muted too, and nothing of torch's is
replaced.

A posthook sees the gradients its node computed (``grad_inputs``): in B
the input path's only, the weights' left for W. So a junction that holds a
posthook when B starts is not deferred: B computes its parameters'
gradients too, and the posthook sees (and may replace) all of them, as in
a plain backward (:func:`has_post_hooks`, read by
:class:`~mpstream.runtime.split_backward.Split`).

A junction's node belongs to one micro-batch, and a step's autograd calls
run on its host thread one after another (a call waits for autograd's
device threads), so no B, nor another micro-batch's W, finds a node W
muted. Only another thread back-propagating through the same nodes could,
which a step's graph never shares.

W gives the junctions zeros (one element in memory: no allocation or
memset per junction), which a retained ``.grad`` adds (``retain_grad``'s
hook is kept apart from the other hooks, and runs), and a node prehook of
W's own, registered once the node's are set aside, hands the junction what
B kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, cast

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from .. import _ext

__all__ = ["Group", "MutedHooks", "has_post_hooks", "mute", "pinned", "zeros_like"]

#: A W call: where it starts, the gradients flowing in there, and the
#: parameters it differentiates.
Group = tuple[list[GradientEdge], list[Tensor], list[Tensor]]

_C = _ext.load()


class MutedHooks(Protocol):
    """A node's hooks, set aside (``mpstream._C.MutedHooks``)."""

    def restore(self) -> None:
        """Gives the node its hooks back, ahead of any it gained meanwhile;
        once (later calls do nothing, as does the object's end)."""

    def __len__(self) -> int:
        """How many hooks are set aside (0 once restored); Python's hooks
        of one kind count once per node (per output for tensor hooks)."""


def mute(node: Node) -> MutedHooks:
    """Takes the hooks off ``node`` until the result's ``restore()``: its
    tensor hooks (those ``Tensor.register_hook`` put there, for each of its
    outputs), its prehooks and its posthooks. ``retain_grad``'s hooks stay.

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


def has_post_hooks(node: Node) -> bool:
    """Whether ``node`` holds posthooks (``node.register_hook``'s, the
    deprecated ``Module.register_backward_hook``'s). Torch keeps their
    holder once they are removed: a node that had one counts.

    Args:
        node: an autograd node, as for :func:`mute`.

    Returns:
        True where it holds one.

    Raises:
        TypeError: ``node`` is not an autograd node.
        ValueError: the node was freed (its graph released).
    """
    return bool(_C.has_post_hooks(node))


@contextmanager
def pinned(kept: dict[Node, list[Any]]) -> Iterator[None]:
    """Around W's autograd calls: each junction starts from the gradients B
    ``kept`` there, and its hooks do not run (see the module's notes).

    Raises:
        RuntimeError: as autograd raised it; the hooks are back in place.
    """
    handles: list[Any] = []
    muted: list[MutedHooks] = []
    try:
        for node, values in kept.items():

            def pin(grad_outputs: tuple[Any, ...], values: list[Any] = values) -> tuple[Any, ...]:
                return tuple(g if v is None else v for g, v in zip(grad_outputs, values))

            # Muted first, so that W's prehook, registered after, stays.
            muted.append(mute(node))
            handles.append(node.register_prehook(pin))
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

"""Which buffers each stage's graphs write, and which they read.

A traced stage reaches the module's buffers through ``get_attr`` nodes, and
its graph says what it does to them: an in-place operation on one or on a
view of it (``self.ema.add_(h.mean())``, ``self.buf[0] = h``, an aten
operation whose schema marks the argument written), or a norm function in
training mode given it as running statistics (``F.batch_norm(h, self.rm,
self.rv, training=True)``, an exported stage's ``batch_norm``). A stage may
also hand a view of a buffer to a later stage (a value a forward keeps
using after the split point: ``torch.export`` passes the result of
``self.calls.add_(1)`` on), which then reads it, and writes it where it
changes it in place. :func:`buffer_uses` reads all of that off the graphs,
once per set of stages, for
:class:`~mpstream.memory.shared_writes.SharedWrites`, which refuses a run
where one stage writes a buffer another uses: the stages run at once on
their own streams. What a module the graph calls whole (a leaf module, a
``Sequential`` stage's layer) does is out of sight here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree

from ..memory.checkpoint import graph_writes
from ..runtime.graph import ALL, Ref, StageGraph
from .inplace import changes_in_place
from .inplace_paths import base

__all__ = ["StageBuffers", "buffer_uses"]

#: Per stage: the buffers its graphs write, and those they read.
StageBuffers = tuple[list[Tensor], list[Tensor]]

# Norm functions that write their running statistics when the flag named
# is true (its default when not given).
_NORMS: dict[Callable[..., Any], tuple[str, bool]] = {
    F.batch_norm: ("training", False),
    F.instance_norm: ("use_input_stats", True),
}
_STATISTICS = ("running_mean", "running_var")


def _norm_statistics(node: fx.Node) -> list[Any]:
    """The running statistics ``node``, a norm function's call, writes."""
    flag, default = _NORMS[node.target]  # type: ignore[index]
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)  # type: ignore[arg-type]
    except TypeError:
        return []  # a call the function refuses raises when it runs
    if bound.arguments.get(flag, default) is False:
        return []  # eval mode, frozen statistics: read only
    return [bound.arguments.get(name) for name in _STATISTICS]


def _buffer(gm: fx.GraphModule, node: fx.Node) -> Tensor | None:
    """The buffer a ``get_attr`` node reads (None for a parameter or no tensor)."""
    try:
        value = gm.get_buffer(str(node.target))
    except AttributeError:
        return None
    return value if isinstance(value, Tensor) and not isinstance(value, nn.Parameter) else None


def _graph_uses(
    gm: fx.GraphModule, given: dict[fx.Node, list[Tensor]]
) -> tuple[dict[int, Tensor], dict[int, Tensor], Callable[[Any], list[Tensor]]]:
    """What ``gm``'s graph writes and reads, with ``given`` the buffers
    each of its inputs views; and what buffers a value of it views."""
    changes = changes_in_place(gm)

    def viewed(value: Any) -> list[Tensor]:
        if not isinstance(value, fx.Node):
            return []
        owner = base(value, changes)
        if owner.op == "get_attr":
            found = _buffer(gm, owner)
            return [] if found is None else [found]
        return given.get(owner, [])

    # An exported norm's batch_norm writes statistics its schema does not
    # mark written (first: a refusal names the statistics before the count).
    writes = {id(b): b for b in graph_writes(gm, statistics=True)}
    reads: dict[int, Tensor] = {}
    for value in changes.values():
        writes.update((id(b), b) for b in viewed(value))
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _NORMS:
            for stat in _norm_statistics(node):
                writes.update((id(b), b) for b in viewed(stat))
        elif node.op in ("get_attr", "placeholder") and node.users:
            reads.update((id(b), b) for b in viewed(node))
    return writes, reads, viewed


def buffer_uses(partitions: Sequence[nn.Module], graph: StageGraph | None) -> list[StageBuffers]:
    """Per stage, the buffers its graphs write and those they read.

    Args:
        partitions: the stages' modules (graph modules found anywhere in
            them are read).
        graph: where each stage's arguments come from, to follow a view of
            a buffer one stage hands to another (None: none is followed).

    Returns:
        One pair (written, read) per stage, each buffer once per list.
    """
    handed: dict[Ref, list[Tensor]] = {}  # the buffers each stage output views
    out: list[StageBuffers] = []
    for s, part in enumerate(partitions):
        writes: dict[int, Tensor] = {}
        reads: dict[int, Tensor] = {}
        for gm in (m for m in part.modules() if isinstance(m, fx.GraphModule)):
            given: dict[fx.Node, list[Tensor]] = {}
            args = graph.args[s] if graph is not None and gm is part else ()
            inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
            for node, ref in zip(inputs, args):
                if ref.index != ALL:
                    given[node] = handed.get(ref, [])
            w, r, viewed = _graph_uses(gm, given)
            writes.update(w)
            reads.update(r)
            if graph is not None and gm is part:
                _hand_on(gm, s, graph.outputs[s], viewed, handed)
        out.append((list(writes.values()), list(reads.values())))
    return out


def _hand_on(
    gm: fx.GraphModule,
    stage: int,
    count: int,
    viewed: Callable[[Any], list[Tensor]],
    handed: dict[Ref, list[Tensor]],
) -> None:
    """Notes in ``handed`` the buffers each of the stage's ``count``
    outputs views (several: its graph returns them as a tuple)."""
    result = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    items = list(result) if count > 1 and isinstance(result, (tuple, list)) else [result]
    for i, item in enumerate(items):
        found = [b for leaf in pytree.tree_leaves(item) for b in viewed(leaf)]
        if found:
            handed[Ref(stage, i)] = found

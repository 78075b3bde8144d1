"""A stage's call met for the first time: its graphs captured, or why not.

:meth:`~.stages.StageGraphs.find` looks a call up once per replayed task;
this module is what it does for a key it has no graphs for (rare: the first
step, a new shape, a changed stage): capture a :class:`~.call.GraphedCall`
(into the stage's gradient store, which ``find`` made first), and, where the
capture fails, mark the stage eager with the reason its warning gives. A
call past a bound runs eagerly too (:func:`overflow`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ..._warn import warn
from ...memory.checkpoint import stage_call
from .backend import Backend, was_raised_eagerly
from .backends import CudaGraphs
from .call import GraphedCall, Source
from .report import GraphWarning
from .state import StageState

__all__ = ["Graphs", "capture", "overflow", "ORDER_KEPT"]

#: Captures whose order :attr:`~.stages.StageGraphs.order` keeps (the first ones).
ORDER_KEPT = 1024


class Graphs(Protocol):
    """What a capture reads and updates of the pipe's graphed stages
    (:class:`~.stages.StageGraphs`, which imports this module)."""

    backend: Backend
    #: (stage, slot) of each capture (the first :data:`ORDER_KEPT`), in order.
    order: list[tuple[int, int]]


def capture(
    graphs: Graphs,
    st: StageState,
    key: tuple[Any, ...],
    at: tuple[int, int],
    stage: nn.Module,
    args: Sequence[Any],
    needs: Sequence[bool] | None,
    ckpt: bool,
    sources: Sequence[Source],
) -> GraphedCall | None:
    """Captures stage ``st``'s call of ``key`` (kept at ``at``: its number
    and generation); None where the capture failed (the stage runs eagerly
    from now on, :attr:`~.state.StageState.reason` says why).

    Raises:
        Exception: the stage's own error, raised while it ran eagerly
            inside the capture (the caller's to see, as without graphs).
    """
    grad = bool(key[2])
    if st.pool is None and st.device.type == "cuda" and isinstance(graphs.backend, CudaGraphs):
        st.pool = torch.cuda.graph_pool_handle()
    fn = stage_call(stage, ckpt)
    try:
        graphed = GraphedCall(
            fn, args, st.module, st.device, grad, graphs.backend, st.store,
            ckpt, bool(key[6]), needs, st.pool, sources,
        )  # fmt: skip
    except Exception as exc:  # anything a graph cannot hold: run eagerly from now on
        if was_raised_eagerly(exc):  # the stage's own error: the caller's to see
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        st.reason = f"capture failed: {type(exc).__name__}: {first}"
        st.failed = True
        # Torch may leave the pinned-memory allocator routing to the
        # failed capture's pool: a later capture gets a pool of its own.
        st.pool = None
        st.calls.clear()
        return None
    st.add(at, graphed)
    if len(graphs.order) < ORDER_KEPT:
        graphs.order.append((st.index, key[0]))
    return graphed


def overflow(st: StageState, why: str) -> None:
    """A call beyond a bound runs eagerly; the first one says so."""
    if not st.overflow:
        st.overflow = True
        warn(
            f"{st.label}: {why}; further such calls run eagerly (run fewer forwards "
            f"before a backward, or fewer batch shapes)",
            GraphWarning,
        )

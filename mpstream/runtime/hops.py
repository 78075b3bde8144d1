"""Copy tasks: what one hop of the stage graph moves of a micro-batch.

A hop carries some outputs of one stage (or the pipeline's inputs) to the
first stage on another device that reads them (:mod:`~mpstream.runtime.graph`).
:func:`send_hop` is every copy task, in a forward run and a training step
alike: it flattens the hop's values, sends their tensors with
:meth:`~mpstream.runtime.copy.Route.send` (each inside a
:class:`~mpstream.runtime.copy.Copy` of its own when autograd records the
run), and keeps the copies in the run's
:class:`~mpstream.runtime.values.Flow` for the stages there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from ..schedules.schedule import Task
from .copy import Copy, Route
from .graph import ALL, Hop
from .microbatch import leaves, rebuild_leaves
from .transfer import GradLink, HostWait, Staging
from .values import Flow

if TYPE_CHECKING:
    from .scheduler import EventScheduler

__all__ = ["send_hop"]


def send_hop(
    flow: Flow,
    hop: Hop,
    sched: EventScheduler,
    task: Task,
    staging: Sequence[Staging] | None,
    *,
    force: bool,
    grad: bool,
) -> None:
    """A copy task: what ``hop`` moves of ``task``'s micro-batch, sent to the
    peer's device and kept in ``flow`` for the stages there.

    Args:
        flow: the run's values.
        hop: the hop the task copies along.
        sched: the pipeline's scheduler (devices and streams).
        task: the copy task (its stage is -1 for the pipeline's inputs).
        staging: per micro-batch, pinned buffers for the inputs' transfers.
        force: copy even between stages on one device (not the inputs).
        grad: inside autograd (a forward run that records gradients): the
            copy is a :class:`~mpstream.runtime.copy.Copy`, whose backward
            sends the gradient back. A training step sends gradients back
            in tasks of their own.
    """
    s, m = task.stage, task.micro
    items, specs, where = _hop_leaves(flow.hop_values(hop, m))
    tensors = [items[i] for i in where]
    buffers: Staging = None
    links: list[GradLink | None] | None = None
    if s < 0:
        buffers = _hop_staging(staging, m, hop, flow.outputs_of(-1, m), where)
        if grad and sched.devices[task.peer].type == "cuda":
            tensors, links = _host_waits(tensors)
    route = Route(sched, s, task.peer, m, force and s >= 0, buffers, links)
    if not grad:
        moved = route.send(tensors)
    else:
        # A node per tensor (see Copy): one for the common hop of one.
        moved = [Copy.apply(route, k, t) for k, t in enumerate(tensors)]
    for i, t in zip(where, moved):
        items[i] = t
    flow.put_moved(hop, m, _rebuild_hop(items, specs))


def _host_waits(tensors: list[Tensor]) -> tuple[list[Tensor], list[GradLink | None] | None]:
    """``tensors`` (an input hop's, bound for a GPU), each host one that
    requires grad behind a :class:`~mpstream.runtime.transfer.HostWait` of
    its own: its gradient comes back asynchronously, and the host consumer
    waits for it (transfer.py). Returns them with their links, the
    :class:`~mpstream.runtime.copy.Route`'s (None: no such tensor)."""
    if not any(t.requires_grad and not t.is_cuda for t in tensors):
        return tensors, None
    links: list[GradLink | None] = []
    waited = []
    for t in tensors:
        link = GradLink() if t.requires_grad and not t.is_cuda else None
        links.append(link)
        waited.append(t if link is None else HostWait.apply(link, t)[0])
    return waited, links


def _hop_leaves(values: Sequence[Any]) -> tuple[list[Any], list[Any], list[int]]:
    """Flattens a hop's values: all leaves, their structures, tensor positions."""
    items: list[Any] = []
    specs: list[Any] = []
    for v in values:
        flat, spec = leaves(v)
        items.extend(flat)
        specs.append((spec, len(flat)))
    return items, specs, [i for i, x in enumerate(items) if isinstance(x, Tensor)]


def _rebuild_hop(items: Sequence[Any], specs: Sequence[Any]) -> list[Any]:
    """The inverse of :func:`_hop_leaves`."""
    out, start = [], 0
    for spec, count in specs:
        out.append(rebuild_leaves(items[start : start + count], spec))
        start += count
    return out


def _hop_staging(
    staging: Sequence[Staging] | None,
    m: int,
    hop: Hop,
    inputs: Sequence[Any],
    where: Sequence[int],
) -> Staging:
    """The staging buffers of an input hop's tensors (its leaves at ``where``).

    ``staging[m]`` lines up with the leaves of all of micro-batch ``m``'s
    inputs; the hop moves those of ``hop.indices``.
    """
    if not staging or staging[m] is None:
        return None
    buffers = staging[m]
    assert buffers is not None
    if hop.indices == (ALL,):
        positions: Sequence[int] = range(len(buffers))
    else:
        counts = [len(leaves(x)[0]) for x in inputs]
        starts = [sum(counts[:k]) for k in range(len(counts))]
        positions = [starts[k] + j for k in hop.indices for j in range(counts[k])]
    return tuple(buffers[positions[i]] for i in where)

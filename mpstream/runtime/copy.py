"""Moving values between stage devices: the one copy every run uses.

:func:`send` copies one tensor from one stage's device to another's, on the
current streams, and marks both tensors for the streams that use them. Every
copy between stages goes through it, whichever way it goes: a forward
value, its gradient back, the input batch from the host (and every copy
task, in a forward run and a training step alike, is
:func:`~mpstream.runtime.hops.send_hop`). What differs is who drives the
gradient's way back. In the user's own loop (``pipe(x)``,
then ``loss.backward()``) a forward copy is a :class:`Copy`, whose backward
sends the gradient, issued by autograd; in a training step the graph is cut
at every stage's inputs and a gradient-copy task sends it
(:mod:`~mpstream.runtime.training`).

The scheduler makes the copy streams current before a copy runs, so the
copy is issued on them. A :class:`Copy`'s gradient copy is opened through
the scheduler too: it runs on the same copy streams, and the receiving
stage's compute stream is ordered after it (by autograd's engine, or by the
scheduler on torch versions whose engine does not; see
:data:`~mpstream.runtime.scheduler.AUTOGRAD_ORDERS_GRAD_COPIES`). The input
batch moves from the host on the io stream of stage 0's device
(:mod:`~mpstream.runtime.transfer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd import profiler

from . import private
from .microbatch import gradless
from .stream import AnyStream, current_stream, record_stream
from .transfer import GradLink, Staging, to_device, to_host

if TYPE_CHECKING:
    from .scheduler import EventScheduler

__all__ = [
    "Copy",
    "Route",
    "send",
]


def send(
    x: Tensor,
    device: torch.device,
    reader: AnyStream | None,
    consumer: AnyStream | None,
    *,
    force: bool = False,
    staging: Tensor | None = None,
) -> Tensor:
    """Copies ``x`` to ``device`` for a stage there, marking both tensors.

    Args:
        x: a value (or a gradient) of one stage.
        device: the other stage's device.
        reader: the stream the copy reads ``x`` on, when ``x`` was allocated
            on another one (None: no mark).
        consumer: the stream that reads the copy (None: no mark).
        force: copy even when ``x`` already is on ``device``.
        staging: a pinned buffer for a pageable host ``x``.

    Returns:
        The copy (``x`` itself when it is on ``device`` and not forced).
    """
    if force and x.device == device:
        # The data flow of stages on separate devices, on one device.
        y = x.clone()
    else:
        # Asynchronous from device or pinned memory; into host memory it
        # blocks, so host work that follows never reads a copy in flight.
        y = to_device(x, device, staging)
    if reader is not None:
        record_stream(x, reader)
    if consumer is not None:
        record_stream(y, consumer)
    return y


class Route:
    """Where one copy task goes, and how.

    Attributes:
        sched: the pipeline's scheduler (streams, devices, grad-copy tasks).
        stage: the source stage; -1 for the input batch.
        peer: the receiving stage (the first one on its device that reads
            the value; its copy stream, or its device's io stream for the
            input, receives it).
        micro: the micro-batch.
        force: copy even between stages on the same device.
        staging: for the input batch, a pinned buffer per tensor (or None).
        links: for the input batch, per tensor, where the asynchronous
            gradient copy of a host input that requires grad leaves its
            event (see :class:`~.transfer.HostWait`); None for the others.
    """

    __slots__ = ("sched", "stage", "peer", "micro", "force", "staging", "links")

    def __init__(
        self,
        sched: EventScheduler,
        stage: int,
        peer: int,
        micro: int,
        force: bool = False,
        staging: Staging = None,
        links: Sequence[GradLink | None] | None = None,
    ) -> None:
        self.sched = sched
        self.stage = stage
        self.peer = peer
        self.micro = micro
        self.force = force
        self.staging = staging
        self.links = links

    def send(self, inputs: Sequence[Tensor]) -> list[Tensor]:
        """The copy task's work: ``inputs`` sent to the peer's device."""
        return [self.send_one(k, x) for k, x in enumerate(inputs)]

    def send_one(self, k: int, x: Tensor) -> Tensor:
        """The copy task's ``k``-th tensor, ``x``, sent to the peer's device."""
        sched, stage = self.sched, self.stage
        # The batch is read on the io stream (host memory or the caller's).
        reader = sched.copy_streams[stage] if stage >= 0 else None
        staging = None if self.staging is None else self.staging[k]
        return send(
            x,
            sched.devices[self.peer],
            reader,
            sched.compute_streams[self.peer],
            force=self.force,
            staging=staging,
        )


class Copy(torch.autograd.Function):
    """One tensor of a copy task inside autograd (the user's own loop): its
    backward sends the gradient back as a gradient-copy task the scheduler
    opens.

    A hop's tensors cross in a node each, never in one together: autograd
    runs every node an output of a node it reaches leads to, with no
    gradient where none came, and calls the tensor hooks on its way with
    None. A value the receiving stage reads only into a result nobody uses
    would then run the backward of what made it, where the plain model
    never reaches it; in a node of its own, it is not reached either.
    """

    @staticmethod
    def forward(ctx: Any, route: Route, k: int, x: Tensor) -> Tensor:  # type: ignore[override]
        y = route.send_one(k, x)
        ctx.route = route
        ctx.k = k
        ctx.src_device = x.device
        ctx.mark_non_differentiable(*gradless((x,), (y,)))
        ctx.set_materialize_grads(False)
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor | None) -> tuple[Any, ...]:
        if g is None:
            # Reached, but nothing came (a node taking several values, such
            # as a stage's timing mark, reached through another): no copy.
            return (None, None, None)
        route: Route = ctx.route
        sched, stage = route.sched, route.stage
        if stage < 0:
            # Gradient of the batch itself, on the io stream (this node's).
            link = None if route.links is None else route.links[ctx.k]
            moved = to_host(g, ctx.src_device, link)
            if link is None and g.is_cuda and moved is not g:
                # Read on the io stream, which only the next call's own input
                # copies would order its replays after (a graphed stage's
                # buffer, rewritten by its next backward): that call waits.
                sched.callers.note_read(sched.devices[route.peer], current_stream(g.device))
            return (None, None, moved)
        scope: AbstractContextManager[object] = nullcontext()
        if private.profiler_enabled():
            scope = profiler.record_function(f"mpstream/copy_grad/stage{stage}/mb{route.micro}")
        handle = sched.begin_grad_copy(stage, route.peer, route.micro)
        try:
            with scope:
                # The scheduler made the stream that reads g current (this
                # node's; see Scheduler::begin_grad_copy).
                moved = send(
                    g,
                    ctx.src_device,
                    current_stream(g.device),
                    sched.compute_streams[stage],
                    force=route.force,
                )
        finally:
            sched.end(handle)
        if g.device.type == "cpu" and moved.is_cuda:
            # A host stage's gradient: this node has no stream (its forward
            # output is on the host), so autograd's engine takes the current
            # stream of the gradient's device, the caller's, for the one the
            # gradient was made on, and orders the consumer after that one
            # alone. The copy ran on the stage's copy stream: order it there.
            seen_by_engine = current_stream(moved.device)
            seen_by_engine.wait_stream(sched.copy_streams[stage])  # type: ignore[union-attr, arg-type]
        return (None, None, moved)

"""Autograd functions that move micro-batches between stage devices.

The scheduler makes the copy streams current before :class:`Copy` runs, so
the forward copy is issued on them and autograd records them as the node's
stream. The backward copy of the gradient is opened through the scheduler
too: it runs on the same copy streams, and the receiving stage's compute
stream is ordered after it (by autograd's engine, or by the scheduler on
torch versions whose engine does not; see
:data:`~mpstream.runtime.scheduler.AUTOGRAD_ORDERS_GRAD_COPIES`). The input batch
moves from the host on the io stream of stage 0's device
(:mod:`~mpstream.runtime.transfer`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd import profiler

from . import private
from .microbatch import gradless
from .stream import AnyStream, current_stream, record_stream
from .transfer import GradLink, to_device, to_host

if TYPE_CHECKING:
    from .scheduler import EventScheduler

__all__ = ["Copy", "Route", "move"]


def move(x: Tensor, device: torch.device, *, force: bool = False) -> Tensor:
    """Copies ``x`` to ``device`` on the current streams.

    Device-to-device copies and copies from pinned memory are asynchronous;
    copies into host memory block, so host work that follows never reads a
    tensor still in flight. With ``force``, a tensor already on ``device`` is
    copied too (the data flow of stages on separate devices, on one device).
    """
    if x.device == device:
        return x.clone() if force else x
    return to_device(x, device)


class Route:
    """Where one :class:`Copy` goes, and how.

    Attributes:
        sched: the pipeline's scheduler (streams, devices, grad-copy tasks).
        stage: the source stage; -1 for the input batch.
        peer: the receiving stage (the first one on its device that reads
            the value; its copy stream, or its device's io stream for the
            input, receives it).
        micro: the micro-batch.
        force: copy even between stages on the same device.
        staging: for the input batch, a pinned buffer per tensor (or None).
        link: for a host input that requires grad, where the asynchronous
            gradient copy leaves its event (see :class:`~.transfer.HostWait`).
    """

    __slots__ = ("sched", "stage", "peer", "micro", "force", "staging", "link")

    def __init__(
        self,
        sched: EventScheduler,
        stage: int,
        peer: int,
        micro: int,
        force: bool = False,
        staging: tuple[Tensor | None, ...] | None = None,
        link: GradLink | None = None,
    ) -> None:
        self.sched = sched
        self.stage = stage
        self.peer = peer
        self.micro = micro
        self.force = force
        self.staging = staging
        self.link = link


def _move(
    x: Tensor,
    device: torch.device,
    reader: AnyStream | None,
    consumer: AnyStream | None,
    force: bool,
    staging: Tensor | None = None,
) -> Tensor:
    """Moves ``x`` and marks both tensors for the streams that use them.

    ``x`` is read by the copy on ``reader`` (it was allocated on another
    stream); the result, allocated on the copy stream, is read by
    ``consumer``.
    """
    y = to_device(x, device, staging) if staging is not None else move(x, device, force=force)
    if reader is not None:
        record_stream(x, reader)
    if consumer is not None:
        record_stream(y, consumer)
    return y


class Copy(torch.autograd.Function):
    """Moves stage ``route.stage``'s outputs (``-1``: inputs) to ``route.peer``'s device."""

    @staticmethod
    def forward(ctx: Any, route: Route, *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        sched, stage = route.sched, route.stage
        dst = sched.devices[route.peer]
        if stage >= 0:
            reader: AnyStream | None = sched.copy_streams[stage]
        else:
            reader = None  # the batch: read on the io stream, host memory or the caller's
        staging = route.staging or (None,) * len(inputs)
        consumer = sched.compute_streams[route.peer]
        outputs = [
            _move(x, dst, reader, consumer, route.force, buf) for x, buf in zip(inputs, staging)
        ]
        ctx.route = route
        ctx.src_devices = [x.device for x in inputs]
        ctx.mark_non_differentiable(*gradless(inputs, outputs))
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:
        route: Route = ctx.route
        sched, stage = route.sched, route.stage
        if stage < 0:
            # Gradient of the batch itself, on the io stream (this node's).
            moved = [
                None if g is None else to_host(g, d, route.link)
                for g, d in zip(grads, ctx.src_devices)
            ]
            return (None, *moved)
        scope: AbstractContextManager[object] = nullcontext()
        if private.profiler_enabled():
            scope = profiler.record_function(f"mpstream/copy_grad/stage{stage}/mb{route.micro}")
        consumer = sched.compute_streams[stage]
        handle = sched.begin_grad_copy(stage, route.peer, route.micro)
        try:
            with scope:
                result: list[Tensor | None] = []
                for g, d in zip(grads, ctx.src_devices):
                    if g is None:
                        result.append(None)
                        continue
                    # The scheduler made the stream that reads g current
                    # (this node's; see Scheduler::begin_grad_copy).
                    reader = current_stream(g.device)
                    result.append(_move(g, d, reader, consumer, route.force))
        finally:
            sched.end(handle)
        return (None, *result)

"""Autograd functions that move micro-batches between stage devices.

The scheduler makes the copy streams current before :class:`Copy` runs, so
the forward copy is issued on them and autograd records them as the node's
stream. The backward copy of the gradient is opened through the scheduler
too: it runs on the same copy streams and ends with the receiving stage's
compute stream waiting on an event recorded after it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd import profiler

from .stream import CPU_STREAM, AnyStream, record_stream

if TYPE_CHECKING:
    from .scheduler import EventScheduler

__all__ = ["Copy", "move"]


def move(x: Tensor, device: torch.device) -> Tensor:
    """Copies ``x`` to ``device`` on the current streams.

    Host-to-device copies from pinned memory and device-to-device copies are
    asynchronous; copies into host memory block, so host work that follows
    never reads a tensor still in flight.
    """
    if x.device == device:
        return x
    non_blocking = device.type == "cuda" and (x.is_cuda or x.is_pinned())
    return x.to(device, non_blocking=non_blocking)


def _move(
    x: Tensor, device: torch.device, reader: AnyStream | None, consumer: AnyStream | None
) -> Tensor:
    """Moves ``x`` and marks both tensors for the streams that use them.

    ``x`` is read by the copy on ``reader`` (it was allocated on another
    stream); the result, allocated on the copy stream, is read by
    ``consumer``.
    """
    y = move(x, device)
    if reader is not None:
        record_stream(x, reader)
    if consumer is not None:
        record_stream(y, consumer)
    return y


class Copy(torch.autograd.Function):
    """Moves stage ``stage``'s output to stage ``stage + 1`` (``-1``: the input)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, sched: EventScheduler, stage: int, micro: int, *inputs: Tensor
    ) -> tuple[Tensor, ...]:
        reader: AnyStream | None = sched.copy_streams[stage] if stage >= 0 else CPU_STREAM
        dst = sched.devices[stage + 1]
        outputs = [_move(x, dst, reader, sched.compute_streams[stage + 1]) for x in inputs]
        ctx.sched = sched
        ctx.stage = stage
        ctx.micro = micro
        ctx.src_devices = [x.device for x in inputs]
        ctx.mark_non_differentiable(*[y for y in outputs if not y.is_floating_point()])
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:
        sched: EventScheduler = ctx.sched
        stage: int = ctx.stage
        if stage < 0:
            # Gradient of the batch itself: the caller's device, plain copy.
            moved = [None if g is None else move(g, d) for g, d in zip(grads, ctx.src_devices)]
            return (None, None, None, *moved)
        scope: AbstractContextManager[object] = nullcontext()
        if torch._C._autograd._profiler_enabled():
            scope = profiler.record_function(f"mpstream/copy_grad/stage{stage}/mb{ctx.micro}")
        reader, consumer = sched.copy_streams[stage + 1], sched.compute_streams[stage]
        handle = sched.begin_grad_copy(stage, ctx.micro)
        try:
            with scope:
                result = [
                    None if g is None else _move(g, d, reader, consumer)
                    for g, d in zip(grads, ctx.src_devices)
                ]
        finally:
            sched.end(handle)
        return (None, None, None, *result)

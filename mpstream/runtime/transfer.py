"""Host ↔ device transfers that never block the host thread.

A pipeline's batch (and a training step's targets) often sits in host
memory. Moving it with ``x.to(device)`` from pageable memory synchronizes the
copy's stream, so the host would wait for whatever that stream had queued
and could no longer run ahead of the device. Instead:

- pageable tensors are staged through pinned memory: one buffer per tensor
  per step, from PyTorch's caching host allocator, which hands the same
  memory back on later steps once the copies that read it have finished
  (it tracks them with events), split into micro-batches as the batch is
  (:func:`micro_staging`); each micro-batch's slice is filled on the host
  inside its transfer task (an input's copy task, a target's target task:
  :func:`micro_to_device`), then moved with ``non_blocking=True``;
- pinned tensors (``DataLoader(pin_memory=True)``) skip the staging copy;
- the gradient of an input that requires grad comes back into pinned memory
  asynchronously on the device's autograd thread; :class:`HostWait` makes
  the host-side consumer (run by autograd on the calling thread) wait for
  it, so the device's thread keeps issuing backward kernels meanwhile.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .microbatch import gradless, leaves, rebuild_leaves, split
from .stream import current_stream, record_stream

__all__ = [
    "Staging",
    "host_staging",
    "micro_staging",
    "to_device",
    "micro_to_device",
    "to_host",
    "GradLink",
    "HostWait",
]


# Pinned staging buffers of one micro-batch (or of a whole batch), one entry
# per leaf of its inputs as host_staging lines them up, or None when nothing
# needs staging.
Staging = tuple[Tensor | None, ...] | None


def _pageable(t: Tensor) -> bool:
    return t.device.type == "cpu" and not t.is_pinned()


def host_staging(value: Any, device: torch.device) -> Staging:
    """Pinned buffers for the pageable tensors of ``value`` bound for ``device``.

    Returns:
        One entry per leaf of ``value`` (a pinned buffer of its shape and
        dtype for a pageable tensor, None for anything else, ``NoChunk``
        included: it moves whole for each micro-batch), or None when nothing
        needs staging: ``device`` is not a CUDA device, or every tensor
        already sits on a device or in pinned memory.
    """
    if device.type != "cuda":
        return None
    items = leaves(value)[0]
    if not any(isinstance(t, Tensor) and _pageable(t) for t in items):
        return None
    return tuple(
        torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        if isinstance(t, Tensor) and _pageable(t)
        else None
        for t in items
    )


def micro_staging(
    value: Any, device: torch.device, chunks: int | None, split_size: int | None
) -> list[Staging] | None:
    """Per micro-batch, pinned buffers for ``value``'s pageable tensors
    bound for ``device`` (aligned with its leaves, as :func:`host_staging`
    lines them up), split as :func:`~.microbatch.scatter` splits the batch;
    None if none needed."""
    buffers = host_staging(value, device)
    if buffers is None:
        return None
    parts = [None if b is None else split(b, chunks, split_size) for b in buffers]
    micros = max(len(p) for p in parts if p is not None)
    out: list[Staging] = [tuple(None if p is None else p[i] for p in parts) for i in range(micros)]
    return out


def to_device(x: Tensor, device: torch.device, staging: Tensor | None = None) -> Tensor:
    """Moves ``x`` to ``device`` on the current stream without blocking the host.

    Args:
        x: the tensor (a micro-batch's slice).
        device: where it goes.
        staging: a pinned buffer shaped like ``x``; a pageable ``x`` is
            copied into it on the host first. Without one, a pageable ``x``
            bound for a GPU gets a buffer of its own from the caching host
            allocator (a CPU stage's output, say).

    Copies into host memory (a CPU stage fed from a GPU) still block: host
    work that follows must not read a tensor still in flight.
    """
    if x.device == device:
        return x
    if staging is None and device.type == "cuda" and _pageable(x):
        staging = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    if staging is not None:
        staging.copy_(x)
        return staging.to(device, non_blocking=True)
    return x.to(device, non_blocking=device.type == "cuda")


def micro_to_device(value: Any, device: torch.device, staging: Staging) -> Any:
    """Moves one micro-batch's inputs (or its target) to ``device`` with
    :func:`to_device`, each pageable tensor through its buffer in
    ``staging`` (one micro-batch's of :func:`micro_staging`, or None)."""
    items, spec = leaves(value)
    # One buffer per leaf, plain ones included (None there), as
    # host_staging lines them up: indexed by leaf, not by tensor.
    buffers = staging or (None,) * len(items)
    for i, t in enumerate(items):
        if isinstance(t, Tensor):
            items[i] = to_device(t, device, buffers[i])
    return rebuild_leaves(items, spec)


class GradLink:
    """Carries the event of an asynchronous gradient copy to the host."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event: torch.cuda.Event | None = None


def to_host(grad: Tensor, device: torch.device, link: GradLink | None) -> Tensor:
    """Copies a gradient back to its input's ``device``.

    A CUDA gradient bound for the host lands in pinned memory asynchronously;
    the event recorded after it goes to ``link``, for :class:`HostWait`.
    Other moves are plain copies.
    """
    if grad.device == device:
        return grad
    if device.type != "cpu" or not grad.is_cuda or link is None:
        # A GPU gradient here is a GPU input's, on another device than stage
        # 0's (a host input that requires grad has a link). The copy reads it
        # on its device's current stream, which autograd's engine made the
        # input Copy node's own (the io stream its forward ran on), and it
        # needs no mark of ours. The engine marks a gradient for the stream
        # of the node it hands it to whenever that stream is not the
        # producing node's and the gradient sits on its device
        # (InputBuffer::add, torch/csrc/autograd/input_buffer.cpp): since
        # torch 2.8 (pytorch#151079) for the first producer ("Case A",
        # record_stream_any_impl on the consumer stream), in 2.7 in cases
        # (2b) and (3b) on the accumulation stream, there the consumer's.
        # The copy orders its destination itself (that device's current
        # stream waits for it), and the destination is new memory. What
        # orders the source's next writer (a graphed stage's backward
        # replay into this buffer) after this read: the caller (Copy.backward).
        return grad.to(device)
    out = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
    stream = current_stream(grad.device)
    record_stream(grad, stream)  # produced on the stage's stream
    out.copy_(grad, non_blocking=True)
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)  # type: ignore[arg-type]
    link.event = event
    return out


class HostWait(torch.autograd.Function):
    """Identity on host tensors; in backward, waits for their gradients' copy.

    Applied to a host input before it moves to a device. Its backward runs on
    autograd's CPU thread (the caller's), after the device thread queued the
    asynchronous copy of the gradient into ``link``'s pinned memory.
    """

    @staticmethod
    def forward(ctx: Any, link: GradLink, *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.link = link
        outputs = tuple(x.detach() for x in inputs)
        ctx.mark_non_differentiable(*gradless(inputs, outputs))
        ctx.set_materialize_grads(False)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        event = ctx.link.event
        if event is not None:
            event.synchronize()
            ctx.link.event = None
        return (None, *grads)

"""Copies between GPUs that run wholly on the receiving device's stream.

PyTorch copies from one GPU to another on the *sending* device's current
stream, fenced with events against both devices' current streams. A step
captured as one graph per device cannot hold that: the copy would be
issued on a stream that is not capturing (it would run once, at capture
time, and never at replay) and the fences would join two captures. So a
segmented run *pulls* (``begin_run(..., pull=True)``): the receiving
device reads the sender's memory through a view of it
(``torch.ops.mpstream.peer_view``, from ``csrc/peer.cpp``) and copies it
on its own current stream, which its capture holds. The run orders the
read after the producer (an external event across graphs, an event
otherwise).

Keeping the sender's memory from being reused while the read is pending:

- while capturing, the source lives in the private memory pool of the
  graph that produced it, which nothing else allocates from, and no
  ``record_stream`` may be issued (a free during another device's capture
  would record an event inside it);
- eagerly, the source is marked as used by the reading stream
  (``record_stream`` accepts another device's stream).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _ext

__all__ = ["enable_peer_access", "pull"]

_ext.load()  # registers torch.ops.mpstream


@torch.library.register_fake("mpstream::peer_view")  # type: ignore[untyped-decorator]
def _peer_view_fake(src: Tensor, device: torch.device) -> Tensor:
    """What the view looks like, for meta and fake tensors (tracing,
    ``torch.export``, shape propagation): ``src``'s sizes, strides and
    dtype on ``device``."""
    return torch.empty_strided(src.size(), src.stride(), dtype=src.dtype, device=device)


def pull(x: Tensor, device: torch.device) -> Tensor:
    """A copy of ``x`` on ``device``, made on ``device``'s current stream.

    Args:
        x: a tensor on another device of the same kind (a CPU tensor is
            copied on the host).
        device: where the copy goes; its current stream must already be
            ordered after whatever wrote ``x``.

    Returns:
        A new tensor on ``device`` with ``x``'s values (dense, ``x``'s
        memory format where it has one).
    """
    view = torch.ops.mpstream.peer_view(x, device)
    out = torch.empty_like(view)
    out.copy_(view)
    if x.is_cuda and not torch.cuda.is_current_stream_capturing():
        x.record_stream(torch.cuda.current_stream(device))
    return out


def enable_peer_access(devices: list[torch.device]) -> None:
    """Lets every CUDA device in ``devices`` read every other's memory.

    PyTorch enables peer access lazily, for the sending device of a copy
    between two GPUs; a pull reads from the receiving side, so both
    directions are enabled here, by one tiny eager copy each way.

    Raises:
        RuntimeError: two of the devices cannot access each other's memory
            (no NVLink or PCIe peer path); a pipe captured per device needs
            it.
    """
    cuda = [d for d in dict.fromkeys(devices) if d.type == "cuda"]
    for a in cuda:
        for b in cuda:
            if a == b:
                continue
            if not torch.cuda.can_device_access_peer(a, b):
                raise RuntimeError(
                    f"{a} cannot read {b}'s memory (no peer access between them): a step "
                    f"captured as a graph per device copies by reading the other device's "
                    f"memory; put the stages on GPUs with a peer path (nvidia-smi topo -m), "
                    f"or run the pipe eagerly"
                )
            torch.empty(1, device=b).copy_(torch.empty(1, device=a))
    for d in cuda:
        torch.cuda.synchronize(d)

"""Memory per stage of a training step: parameters, gradients, optimizer
state and activations at peak, measured.

The first three are the bytes of the tensors themselves after a step
(``.grad`` read before the optimizer's ``zero_grad``, the optimizer's state
per parameter). Activations at peak are what each stage's forwards saved
for backward and held at once during the step
(:class:`~mpstream.memory.StageSavedBytes`: storages counted once, on any
device, all stages on one GPU included); for stages replayed from CUDA
graphs, whose activations sit in the graphs' pools, the pools' bytes plus
the static buffers their graphs read and write outside the pools (inputs,
outputs, output and input gradients of every slot:
:class:`~mpstream.runtime.graphed.StageReport`'s ``reserved_bytes`` and
``static_bytes``), and for a one-stage step captured whole, its graph's
pool plus the static input and target buffers it copies each batch into
outside the pool (:class:`~mpstream.CapturedStep`'s ``reserved_bytes``
and ``static_bytes``; run eagerly, on the CPU, the saved tensors plus
those buffers). A module that is not a pipe (the single device, naive
model parallel) counts its parts as stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ..memory import StageSavedBytes
from ..pipe import Pipe

__all__ = ["KINDS", "per_stage", "parts_of"]

#: What each stage's memory is made of, in the figures' order.
KINDS = ("parameters", "gradients", "optimizer", "activations")


def parts_of(module: nn.Module) -> list[nn.Module]:
    """The stages of a pipe, the parts of a naive split, or the module itself."""
    if isinstance(module, Pipe):
        return list(module.partitions)
    parts = getattr(module, "parts", None)
    return list(parts) if isinstance(parts, nn.ModuleList) else [module]


def _bytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def per_stage(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: Callable[[], None],
    devices: Sequence[torch.device] = (),
    graph_bytes: int = 0,
    static_bytes: int = 0,
) -> tuple[list[dict[str, int]], dict[str, int]]:
    """Runs one more ``step`` (which zeroes the gradients first).

    Args:
        module: what ``step`` trains (a pipe, or a module of parts).
        optimizer: what ``step`` steps.
        step: one training step.
        devices: the devices it runs on.
        graph_bytes: for a one-stage step replayed as one CUDA graph, its
            pool's bytes, where its activations sit (a replay saves
            nothing the tracker sees); 0 otherwise.
        static_bytes: for a one-stage step run by a
            :class:`~mpstream.CapturedStep`, the buffers it holds outside
            any pool (its ``static_bytes``), added to the activations:
            an eager step does not hold them; 0 otherwise.

    Returns:
        Per stage, the bytes of each of :data:`KINDS`; and per CUDA device
        among ``devices``, the allocator's peak during the step (every
        stage on it together).
    """
    parts = parts_of(module)
    gpus = sorted({d for d in devices if d.type == "cuda"}, key=str)
    for d in gpus:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)
    tracker = StageSavedBytes(parts)
    with tracker:
        step()  # zeroes the gradients first: after it, .grad is this step's
    peaks = {str(d): torch.cuda.max_memory_allocated(d) for d in gpus}
    grads = [_bytes([p.grad for p in part.parameters() if p.grad is not None]) for part in parts]
    activations = list(tracker.peak_bytes)
    if isinstance(module, Pipe) and module.graphed:
        report = module.graph_report().stages
        activations = [st.reserved_bytes + st.static_bytes for st in report]
    elif graph_bytes:
        if len(parts) != 1:
            raise ValueError(f"graph_bytes is one stage's, but the module has {len(parts)}")
        activations = [graph_bytes]
    if static_bytes:
        if len(parts) != 1:
            raise ValueError(f"static_bytes is one stage's, but the module has {len(parts)}")
        activations[0] += static_bytes
    out = []
    for s, part in enumerate(parts):
        params = list(part.parameters())
        state = [
            t for p in params for t in optimizer.state.get(p, {}).values() if isinstance(t, Tensor)
        ]
        out.append(
            {
                "parameters": _bytes(params),
                "gradients": grads[s],
                "optimizer": _bytes(state),
                "activations": activations[s],
            }
        )
    return out, peaks

"""What a failed training step must put back: gradients and BatchNorm state.

``Pipe.train_step`` takes a :class:`Snapshot` before it runs and restores it
if anything raises, so a failure leaves no half-accumulated gradient and no
half-updated running statistic behind.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parameter import is_lazy

from ..memory.batchnorm import DeferredBatchNorm
from ..runtime.stream import current_stream, record_stream

__all__ = ["Snapshot"]


class Snapshot:
    """Gradients and BatchNorm state of a pipe, restorable after a failure.

    BatchNorm buffers (small) are cloned up front. Gradients are saved per
    stage by :meth:`save_grads`, which the worker calls inside the stage's
    first backward task: nothing accumulates into them before that, and a
    step that starts without gradients, or fails before any backward, clones
    nothing.

    Args:
        module: the pipe (its BatchNorm layers are found in it).
        partitions: one module per stage (whose parameters each stage's
            backward accumulates into).
        loss: the loss function, when a module: the last stage's backward
            accumulates into its parameters too (a learnable loss scale).
    """

    def __init__(
        self, module: nn.Module, partitions: Sequence[nn.Module], loss: object = None
    ) -> None:
        self.partitions = list(partitions)
        self.loss = loss if isinstance(loss, nn.Module) else None
        # Per parameter: its gradient tensor before the step, and a copy.
        self.grads: dict[int, tuple[nn.Parameter, Tensor | None, Tensor | None]] = {}
        # Uninitialised (lazy) buffers hold nothing yet to put back.
        self.norms = [
            (m, [(b, b.detach().clone()) for b in m.buffers(recurse=False) if not is_lazy(b)])
            for m in module.modules()
            if isinstance(m, _NormBase)
        ]

    def save_grads(self, stage: int) -> None:
        """Saves the gradients of ``stage``'s parameters (on the current stream);
        a parameter shared by stages is saved once, before its first use."""
        params = list(self.partitions[stage].parameters())
        if self.loss is not None and stage == len(self.partitions) - 1:
            params += self.loss.parameters()
        for p in params:
            if id(p) not in self.grads:
                g = p.grad
                self.grads[id(p)] = (p, g, None if g is None else g.detach().clone())

    def restore(self) -> None:
        """Puts the saved gradients and statistics back (on the caller's stream)."""
        for p, before, g in self.grads.values():
            if g is None:
                p.grad = None
                continue
            # Cloned on a stage stream; the caller's stream uses it now.
            record_stream(g, current_stream(g.device))
            if before is not None and p.grad is before:
                # In place: views of the gradient (DDP's buckets, an
                # optimizer's flat buffers) must see it restored too.
                with torch.no_grad():
                    before.copy_(g)
            else:
                p.grad = g
        for m, buffers in self.norms:
            # Through .data: graphs still alive may have saved these buffers.
            for b, saved in buffers:
                b.data.copy_(saved)
            if isinstance(m, DeferredBatchNorm):
                m.reset_accumulation()

"""What a failed training step must put back: gradients and BatchNorm state.

``Pipe.train_step`` takes a :class:`Snapshot` before it runs and restores it
if anything raises, so a failure leaves no half-accumulated gradient and no
half-updated running statistic behind.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parameter import is_lazy

from .. import _ext
from ..memory.batchnorm import DeferredBatchNorm
from ..runtime.stream import current_stream, record_stream

__all__ = ["Snapshot", "Norms"]

_grad = operator.attrgetter("grad")
_dtype = operator.attrgetter("dtype")


def _copies(grads: list[Tensor]) -> list[Tensor]:
    """Copies of ``grads``, in order: one multi-tensor copy per dtype (the
    multi-tensor kernel takes one; a stage's gradients share its device)
    instead of a clone, and on a GPU a launch, per gradient."""
    copies = list(map(torch.empty_like, grads))
    dtypes = set(map(_dtype, grads))
    with torch.no_grad():  # a gradient of create_graph=True needs one itself
        if len(dtypes) == 1:
            torch._foreach_copy_(copies, grads)
            return copies
        for dtype in dtypes:
            picked = [i for i, g in enumerate(grads) if g.dtype == dtype]
            torch._foreach_copy_([copies[i] for i in picked], [grads[i] for i in picked])
    return copies


class Norms:
    """A pipe's BatchNorm buffers and a copy of them, taken with one
    multi-tensor copy per device and dtype (the pipe keeps one
    :class:`Norms`, rebuilt when its buffers change)."""

    def __init__(self, module: nn.Module) -> None:
        self.modules = [m for m in module.modules() if isinstance(m, _NormBase)]
        # Uninitialised (lazy) buffers hold nothing yet to put back.
        self.buffers = [b for m in self.modules for b in m.buffers(recurse=False) if not is_lazy(b)]
        self.copies = [torch.empty_like(b) for b in self.buffers]
        self.watch = _ext.load().Watch(self.buffers)
        # By dtype too: a list mixing the statistics' float and the counter's
        # int64 misses the multi-tensor kernel, and on a GPU each buffer's
        # copy is a launch of its own, at every step.
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
        for c, b in zip(self.copies, self.buffers):
            pair = groups.setdefault((b.device, b.dtype), ([], []))
            pair[0].append(c)
            pair[1].append(b)
        self.groups = list(groups.values())

    def stale(self) -> bool:
        """Whether a buffer moved or changed shape since (rebuild then)."""
        return bool(self.watch.changed())

    def save(self) -> None:
        """Copies the buffers (on the current streams)."""
        for copies, buffers in self.groups:
            torch._foreach_copy_(copies, buffers)

    def restore(self) -> None:
        """Puts the copies back, and deferred BatchNorm's accumulation."""
        # Through .data: graphs still alive may have saved these buffers.
        for b, saved in zip(self.buffers, self.copies):
            b.data.copy_(saved)
        for m in self.modules:
            if isinstance(m, DeferredBatchNorm):
                m.reset_accumulation()


class Snapshot:
    """Gradients and BatchNorm state of a pipe, restorable after a failure.

    BatchNorm buffers (small) are copied up front. Gradients are saved per
    stage by :meth:`save_grads`, which the training step calls inside the stage's
    first backward task: nothing accumulates into them before that, and a
    step that starts without gradients, or fails before any backward, clones
    nothing. Parameters whose gradients graphed stages keep in their own
    buffers are saved there instead (``saved``).

    Args:
        norms: the pipe's BatchNorm buffers (see :class:`Norms`).
        params: per stage, the parameters its backward accumulates into.
        loss: the loss function, when a module: the last stage's backward
            accumulates into its parameters too (a learnable loss scale).
        saved: per stage whose gradients graphed stages saved, the
            parameters left to save here (tied ones); the others are saved
            in full.
        zeroed: every existing gradient is known to be zero (a captured
            zeroing just ran): nothing is cloned, and a restore zeroes them.
    """

    def __init__(
        self,
        norms: Norms,
        params: Sequence[Sequence[nn.Parameter]],
        loss: object = None,
        saved: Mapping[int, Sequence[nn.Parameter]] | None = None,
        zeroed: bool = False,
    ) -> None:
        self.params = [saved.get(s, ps) for s, ps in enumerate(params)] if saved else params
        self.zeroed = zeroed
        self.loss = loss if isinstance(loss, nn.Module) else None
        # Per parameter: its gradient tensor before the step, and a copy.
        self.grads: dict[int, tuple[nn.Parameter, Tensor | None, Tensor | None]] = {}
        self.norms = norms
        norms.save()

    def save_grads(self, stage: int) -> None:
        """Saves the gradients of ``stage``'s parameters (on the current stream);
        a parameter shared by stages is saved once, before its first use."""
        params = list(self.params[stage])
        if self.loss is not None and stage == len(self.params) - 1:
            params += self.loss.parameters()
        fresh = [p for p in dict.fromkeys(params) if id(p) not in self.grads]
        grads = list(map(_grad, fresh))
        present = [g for g in grads if g is not None]
        copies = iter(() if self.zeroed or not present else _copies(present))
        for p, g in zip(fresh, grads):
            self.grads[id(p)] = (p, g, None if g is None or self.zeroed else next(copies))

    def restore(self) -> None:
        """Puts the saved gradients and statistics back (on the caller's stream)."""
        for p, before, g in self.grads.values():
            if self.zeroed and before is not None:
                with torch.no_grad():
                    before.zero_()
                p.grad = before
                continue
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
        self.norms.restore()

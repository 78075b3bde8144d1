"""What a stage's capture puts back: its buffers, BatchNorm counters, random state.

Capturing a :class:`~mpstream.runtime.graphed.call.GraphedCall` runs the
stage (warm-up calls, then the captured one), and running it changes the
stage: BatchNorm updates its running statistics, a
:class:`~mpstream.memory.batchnorm.DeferredBatchNorm` counts the
micro-batch, dropout draws from the generators. None of that is a call the
user made, so :func:`restored` puts it all back once capture ends, whether
it succeeded or raised.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ...memory.batchnorm import DeferredBatchNorm

__all__ = ["restored"]


@contextmanager
def restored(stage: nn.Module) -> Iterator[None]:
    """Puts back on exit what warm-up and capture may change: the stage's
    buffers, its deferred BatchNorm counters, the random number generators."""
    buffers = [(b, b.detach().clone()) for b in stage.buffers()]
    counters = [(n, n.tracked, n.hold) for n in stage.modules() if isinstance(n, DeferredBatchNorm)]
    for n, _, _ in counters:
        n.hold = True  # a commit must not be captured: each replay would run it
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        # Through .data, which leaves the version counter alone: capture
        # put back is no change, and an earlier micro-batch's forward may
        # have saved a buffer for its pending backward (BatchNorm saves its
        # running statistics), whose version check would fail.
        for b, saved in buffers:
            b.data.copy_(saved)
        for n, tracked, hold in counters:
            n.tracked, n.hold = tracked, hold
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

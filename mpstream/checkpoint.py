"""Activation checkpointing of pipeline stages.

A checkpointed stage keeps only its input; autograd recomputes its forward
during backward, on the stage's own compute stream (the recomputation is
triggered by the first backward node that needs a saved tensor, and autograd
runs each node on the stream its forward used). RNG state is restored so
dropout draws the same masks. ``torch.utils.checkpoint`` does the work; this
module adds the policy (which micro-batches) and a recompute context that
keeps BatchNorm running statistics from being updated a second time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import checkpoint as torch_checkpoint

__all__ = ["MODES", "check_mode", "checkpoint_stop", "is_recomputing", "checkpointed"]

MODES = ("always", "except_last", "never")

_local = threading.local()


def check_mode(mode: object) -> str:
    """Validates a checkpoint mode.

    Raises:
        ValueError: ``mode`` is not one of :data:`MODES`.
    """
    if mode not in MODES:
        valid = ", ".join(repr(m) for m in MODES)
        raise ValueError(f"checkpoint must be one of {valid}; got {mode!r}")
    return str(mode)


def checkpoint_stop(mode: str, micros: int, training: bool) -> int:
    """How many leading micro-batches are checkpointed.

    ``'except_last'`` spares the last micro-batch, whose backward starts
    right after its forward; eval mode and ``'never'`` checkpoint nothing.
    """
    if not training or mode == "never":
        return 0
    if mode == "except_last":
        return micros - 1
    return micros


def is_recomputing() -> bool:
    """Whether the calling thread is recomputing a checkpointed stage."""
    return bool(getattr(_local, "recomputing", False))


@contextmanager
def _recompute(stage: nn.Module) -> Iterator[None]:
    # The recomputation sees the same batch as the original forward, so
    # BatchNorm normalises identically; only its running statistics must not
    # be updated twice. They are saved before and put back after: both run on
    # the stage's stream in order, and the buffers are small. (Changing
    # track_running_stats instead would change what batch_norm saves for
    # backward, which the checkpoint's determinism check rejects.) The copy
    # goes through .data so the buffers' version counters do not move:
    # other micro-batches' graphs saved them, as batch_norm does.
    norms = [m for m in stage.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    saved = [[b.clone() for b in m.buffers(recurse=False)] for m in norms]
    previous = getattr(_local, "recomputing", False)
    _local.recomputing = True
    try:
        yield
    finally:
        _local.recomputing = previous
        for m, buffers in zip(norms, saved):
            for b, copy in zip(m.buffers(recurse=False), buffers):
                b.data.copy_(copy)


def checkpointed(stage: nn.Module, *args: Any) -> Any:
    """Runs ``stage(*args)`` keeping only ``args``; backward recomputes the rest."""
    return torch_checkpoint.checkpoint(
        stage,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=lambda: (nullcontext(), _recompute(stage)),
    )

"""Memory: what a stage keeps for backward, and what it costs.

Activation checkpointing (which micro-batches recompute their forward during
backward), deferred BatchNorm (running statistics updated once per
mini-batch) and the accounting of bytes saved for backward. These are
policies and measurements over plain modules and autograd: the package imports
nothing of mpstream, so the runtime can apply them.
"""

from __future__ import annotations

from .batchnorm import DeferredBatchNorm
from .checkpoint import MODES as CHECKPOINT_MODES
from .checkpoint import is_checkpointing, is_recomputing
from .saved import SavedTensorTracker, StageSavedBytes

__all__ = [
    "CHECKPOINT_MODES",
    "DeferredBatchNorm",
    "is_checkpointing",
    "is_recomputing",
    "SavedTensorTracker",
    "StageSavedBytes",
]

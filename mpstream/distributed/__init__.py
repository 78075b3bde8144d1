"""Data parallelism over pipelines: one :class:`~mpstream.Pipe` per process under DDP.

:mod:`.ddp` wraps a pipe in ``DistributedDataParallel`` (checking the
options a pipeline cannot take), runs its training step and maps
checkpoints between processes' devices; :mod:`.gradients` averages the
gradients over the processes, each stage's as soon as its backward ends.
"""

from .ddp import check_placement, map_location, sync_buffers, train_step, wrap
from .gradients import StageReducer, sync_gradients

__all__ = [
    "wrap",
    "train_step",
    "sync_gradients",
    "sync_buffers",
    "map_location",
    "check_placement",
    "StageReducer",
]

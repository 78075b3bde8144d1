"""Data parallelism over pipelines: one :class:`~mpstream.Pipe` per process under DDP.

:mod:`.ddp` wraps a pipe in ``DistributedDataParallel`` (checking the
options a pipeline cannot take) and runs its training step;
:mod:`.gradients` averages the gradients over the processes, each stage's
as soon as its backward ends; :mod:`.pending` refuses a step while DDP's
reducer still waits for a forward's backward; :mod:`.placement` checks the stage devices
a process group can reduce on and maps checkpoints between processes'
devices.
"""

from .ddp import sync_buffers, train_step, wrap
from .gradients import StageReducer, sync_gradients
from .placement import check_placement, map_location

__all__ = [
    "wrap",
    "train_step",
    "sync_gradients",
    "sync_buffers",
    "map_location",
    "check_placement",
    "StageReducer",
]

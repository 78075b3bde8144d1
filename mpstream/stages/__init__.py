"""Stages: how a module is cut into pipeline stages and placed on devices.

A Sequential is partitioned by layer counts (:mod:`.sequential`); any other
module is traced with ``torch.fx`` and split at named submodules
(:mod:`.fx`) or exported with ``torch.export`` and cut at named calls
(:mod:`.export`, :mod:`.exported`); :mod:`.placement` puts each stage's
tensors on its device; :mod:`.balance` profiles layers and chooses the cut that
minimises the slowest stage; :mod:`.build` decides which applies and returns
the stages, their devices and their :class:`~mpstream.StageGraph`.

May import :mod:`mpstream.runtime` and :mod:`mpstream.schedules`; never the
pipe or any tool.
"""

from __future__ import annotations

from .balance import balance_by_size, balance_by_time, profile_layers
from .partition import partition, stage_costs
from .sequential import check_device_exists, check_flag, check_positive
from .tracers import SplitReport

__all__ = [
    "balance_by_time",
    "balance_by_size",
    "profile_layers",
    "partition",
    "stage_costs",
    "SplitReport",
    "check_flag",
    "check_positive",
    "check_device_exists",
]

"""Schedules: which task runs when, as the ordered task list one host thread issues.

The built-in schedules (fill-drain, 1F1B, interleaved 1F1B, zero-bubble H1)
and orders written by hand, all generated and checked by the C++ core
(``csrc/schedule.cpp``, ``csrc/orders.cpp``); :mod:`.slots` and
:mod:`.segments` derive the graph slots and the capture segments of one.
Imports nothing of mpstream but the extension loader (``mpstream._ext``): a
schedule is plain data, so everything else may build on it.
"""

from __future__ import annotations

from .orders import Action, format_order, parse
from .schedule import (
    SCHEDULES,
    Kind,
    Order,
    Schedule,
    Task,
    Topology,
    check_schedule,
    schedule_arg,
    virtual_stages_of,
)
from .segments import Segments, segment

__all__ = [
    "SCHEDULES",
    "Kind",
    "Order",
    "Schedule",
    "Task",
    "Topology",
    "Action",
    "parse",
    "format_order",
    "check_schedule",
    "schedule_arg",
    "virtual_stages_of",
    "Segments",
    "segment",
]

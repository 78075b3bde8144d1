"""Schedules: which task runs when, as the ordered task list one host thread issues.

The built-in schedules (fill-drain, 1F1B, interleaved 1F1B, zero-bubble
H1, looped BFS, interleaved zero-bubble, ZB-V, DualPipe-V) and orders
written by hand, all generated and checked by the C++ core
(``csrc/schedule.cpp``, ``csrc/orders.cpp``, ``csrc/orders_v.cpp``);
:mod:`.placement` says which stages each puts on one rank and checks the
devices against it; :mod:`.auto` holds what ``schedule="auto"`` is asked
and reports; :mod:`.slots` derives the graph slots (and the activations
held) of one.
Imports nothing of mpstream but the extension loader (``mpstream._ext``): a
schedule is plain data, so everything else may build on it.
"""

from __future__ import annotations

from .auto import Auto, Candidate, ScheduleReport, pick
from .orders import Action, format_order, parse
from .placement import (
    PLACEMENTS,
    default_ranks,
    placement_of,
    rank_devices,
    v_stages_of,
    virtual_stages_for,
)
from .schedule import (
    SCHEDULES,
    Kind,
    Order,
    PipeSchedule,
    Schedule,
    Task,
    Topology,
    check_schedule,
    schedule_arg,
    virtual_stages_of,
)
from .slots import peak_activations

__all__ = [
    "SCHEDULES",
    "PLACEMENTS",
    "Kind",
    "Order",
    "PipeSchedule",
    "Schedule",
    "Task",
    "Topology",
    "Action",
    "parse",
    "format_order",
    "check_schedule",
    "schedule_arg",
    "virtual_stages_of",
    "v_stages_of",
    "virtual_stages_for",
    "placement_of",
    "rank_devices",
    "default_ranks",
    "peak_activations",
    "Auto",
    "Candidate",
    "ScheduleReport",
    "pick",
]

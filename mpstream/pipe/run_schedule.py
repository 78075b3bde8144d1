"""The schedule of one run of a pipe: which, and for what topology.

A forward-only run (``pipe(x)``) is fill-drain; a training step takes the
pipe's ``schedule`` with its virtual stages, or what ``schedule='auto'``
chose for the latest step (see :mod:`~mpstream.pipe.auto`):
:func:`step_schedule`. The run's topology (which stage reads which, the
stages' devices, where the batch and the targets sit, copies forced) fixes
its transfer and copy tasks; :func:`run_schedule` builds the schedule of
each kind of run once, kept in the pipe's runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..runtime.graph import StageGraph
from ..schedules.placement import placement_of, virtual_stages_for
from ..schedules.schedule import PipeSchedule, Schedule, Topology, schedule_arg
from .auto import Choices, auto_of

__all__ = ["step_schedule", "run_schedule"]

# A schedule's name (or explicit order) and its virtual stages per rank.
Chosen = tuple[str | tuple[str, ...], int]


def step_schedule(
    schedule: PipeSchedule,
    choices: Choices,
    devices: Sequence[torch.device],
    virtual_stages: int | None,
) -> Chosen:
    """The schedule a training step runs, and its virtual stages.

    Args:
        schedule: the pipe's ``schedule``.
        choices: what ``schedule='auto'`` chose.
        devices: the stages' devices.
        virtual_stages: the pipe's ``virtual_stages`` (None: inferred).

    Returns:
        The name (or explicit order) and the virtual stages per rank.

    Raises:
        RuntimeError: ``schedule='auto'`` has not chosen yet.
        ValueError: the schedule does not fit the stages' placement.
    """
    if auto_of(schedule) is not None:
        report = choices.latest
        if report is None:
            raise RuntimeError(
                "schedule='auto' has not chosen a schedule yet: it does at the first "
                "train_step (pipe.schedule_report() then says which and why)"
            )
        return report.chosen, report.virtual_stages
    name: str | tuple[str, ...] = schedule_arg(schedule)  # type: ignore[assignment]
    try:
        virtual = virtual_stages_for(name, devices, virtual_stages)
    except ValueError as exc:
        raise ValueError(f"{exc} (set pipe.virtual_stages or pipe.schedule)") from None
    return name, virtual


def run_schedule(
    cache: dict[tuple[Any, ...], Schedule],
    devices: Sequence[torch.device],
    graph: StageGraph,
    chosen: Chosen | None,
    micros: int,
    input_device: torch.device | str,
    target_device: torch.device | str | None,
    force_copies: bool,
) -> Schedule:
    """The schedule of a run, built once per kind of run.

    Args:
        cache: the schedules built so far, by kind of run (the runtime's).
        devices: the stages' devices.
        graph: where each stage's arguments come from.
        chosen: a training step's schedule (:func:`step_schedule`), or
            None: a forward-only run's (fill-drain).
        micros: the micro-batch count of the run.
        input_device: where the batch sits (a device or its name).
        target_device: where a training step's target sits (a device or
            its name), or None.
        force_copies: the pipe's ``force_copies``.

    Returns:
        The schedule.
    """
    # A string ("cpu") equals no torch.device: it would read as a batch
    # (or target) off the stages' devices, adding transfers the run has not.
    if isinstance(input_device, str):
        input_device = torch.device(input_device)
    if isinstance(target_device, str):
        target_device = torch.device(target_device)
    training_step = chosen is not None
    name, virtual = chosen or ("gpipe", 1)
    if placement_of(name) == "stage":
        virtual = 1
    copy_target = training_step and target_device not in (None, devices[-1])
    key = (name, micros, input_device, training_step, copy_target, force_copies, virtual)
    sched = cache.get(key)
    if sched is None:
        labels = list(dict.fromkeys(devices))
        topology = Topology(
            graph.reads(),
            tuple(labels.index(d) for d in devices),
            labels.index(input_device) if input_device in labels else -1,
            force_copies,
        )
        sched = Schedule(
            name,
            len(devices),
            micros,
            topology,
            backward=training_step,
            copy_target=copy_target,
            virtual_stages=virtual,
        )
        cache[key] = sched
    return sched

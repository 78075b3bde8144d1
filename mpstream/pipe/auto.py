"""``Pipe(schedule="auto")``: when the schedule is chosen, and through which hook.

The choice needs the micro-batch count and the step's costs, so it happens
at the first :meth:`~mpstream.Pipe.train_step` (``pipe(x)`` runs
fill-drain whatever the schedule, and chooses nothing). Which built-in
schedules fit the placement is the core's to say (:func:`candidates`); how
fast each runs is the cost model's, which lives with the tools
(:mod:`mpstream.observe`: the simulator, profiles, fitted costs and the
tuning cache). The core may not import the tools, so the tools install a
:data:`Chooser` here (:func:`install_chooser`, when ``mpstream.observe``
is imported, as ``import mpstream`` does) and the Pipe calls it. A
choice (:class:`~mpstream.schedules.auto.ScheduleReport`, from
``pipe.schedule_report()``) is kept per micro-batch sizes until the
schedule or ``virtual_stages`` is set again (:class:`Choices`): a later
step with sizes already seen runs what was chosen for them, one with new
sizes chooses.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from ..runtime.errors import annotate
from ..schedules import (
    SCHEDULES,
    Auto,
    ScheduleReport,
    check_schedule,
    placement_of,
    virtual_stages_for,
)

__all__ = [
    "AutoRequest",
    "Chooser",
    "Choices",
    "install_chooser",
    "candidates",
    "choose",
    "auto_of",
]


@dataclass(frozen=True)
class AutoRequest:
    """What a :data:`Chooser` is asked.

    Attributes:
        auto: the options (``Pipe(schedule=Auto(...))``).
        inputs: the first step's batch, as ``train_step`` was given it.
        target: its targets.
        loss_fn: its loss function (None: the module's own loss).
        micros: its micro-batch count.
        candidates: (schedule, virtual stages) of each built-in schedule
            that fits the pipe's placement.
        excluded: (schedule, why) of those that do not.
    """

    auto: Auto
    inputs: Any
    target: Any
    loss_fn: Callable[[Any, Any], Any] | None
    micros: int
    candidates: tuple[tuple[str, int], ...]
    excluded: tuple[tuple[str, str], ...]


# (pipe, request) -> report: simulates the candidates and picks one.
Chooser = Callable[[Any, AutoRequest], ScheduleReport]

_installed: list[Chooser] = []


def install_chooser(chooser: Chooser) -> None:
    """Makes ``chooser`` the one ``schedule="auto"`` calls (the last one
    installed wins)."""
    _installed[:] = [chooser]


def auto_of(schedule: object) -> Auto | None:
    """The options of an automatic schedule; None for any other."""
    if isinstance(schedule, Auto):
        return schedule
    return Auto() if schedule == "auto" else None


def candidates(
    devices: Sequence[Hashable], virtual_stages: int | None
) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]:
    """The built-in schedules that fit a placement.

    A schedule of a rank per stage fits any devices (``virtual_stages`` is
    for the others); one of several stages per rank fits when the devices,
    or on one device ``virtual_stages``, give its ranks.

    Returns:
        ``(fitting, excluded)``: (name, virtual stages) of each that fits,
        and (name, why) of each that does not.

    Raises:
        ValueError: ``virtual_stages`` (set after the pipe was built) fits
            none of the schedules of several stages per rank.
    """
    check_schedule("auto", devices, (), virtual_stages)
    fitting, excluded = [], []
    for name in SCHEDULES:
        given = None if placement_of(name) == "stage" else virtual_stages
        try:
            fitting.append((name, virtual_stages_for(name, devices, given)))
        except ValueError as exc:
            excluded.append((name, str(exc)))
    return tuple(fitting), tuple(excluded)


def choose(
    pipe: Any,
    auto: Auto,
    inputs: Any,
    target: Any,
    loss_fn: Callable[[Any, Any], Any] | None,
    micros: int,
) -> ScheduleReport:
    """Asks the installed chooser for ``pipe``'s schedule.

    Raises:
        RuntimeError: no chooser is installed (``mpstream.observe`` was
            never imported).
        ValueError: the chooser's: no schedule fits the memory budget.
    """
    if not _installed:
        raise RuntimeError(
            "schedule='auto' is chosen by mpstream's cost model, which was not loaded: "
            "import mpstream (or mpstream.observe) before the first train_step, or give "
            "a schedule by name"
        )
    fitting, excluded = candidates(pipe.devices, pipe.virtual_stages)
    request = AutoRequest(auto, inputs, target, loss_fn, micros, fitting, excluded)
    return _installed[0](pipe, request)


class Choices:
    """What ``schedule="auto"`` chose for one pipe: per micro-batch sizes,
    and the choice of the latest step (what ``pipe.schedule_report()``
    shows and the next schedule runs). A new schedule or ``virtual_stages``
    replaces the whole object, so a saved one is restored by putting it back.
    """

    def __init__(self) -> None:
        self.by_sizes: dict[tuple[int, ...], ScheduleReport] = {}
        self.latest: ScheduleReport | None = None

    def report(self, schedule: object) -> ScheduleReport:
        """The latest choice, for ``pipe.schedule_report()``.

        Raises:
            ValueError: ``schedule`` is not ``'auto'``.
            RuntimeError: nothing was chosen yet.
        """
        if auto_of(schedule) is None:
            named = (
                f"your order of {len(schedule)} actions"
                if isinstance(schedule, tuple)
                else repr(schedule)
            )
            raise ValueError(
                f"the schedule is {named}, chosen by you: schedule_report() describes what "
                f"schedule='auto' chose"
            )
        if self.latest is None:
            raise RuntimeError(
                "schedule='auto' chooses at the first train_step (when the batch and the "
                "micro-batch count are known), and none has chosen yet: run one (if one "
                "failed while choosing, its error says why)"
            )
        return self.latest

    def choose(
        self,
        pipe: Any,
        inputs: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], Any] | None,
        sizes: tuple[int, ...],
    ) -> None:
        """Chooses ``pipe``'s schedule before a step with micro-batches of
        ``sizes`` rows, unless one was chosen for them (nothing for a
        schedule other than ``'auto'``): the best schedule, and which fit a
        memory budget, depend on the micro-batch count and size.

        Raises:
            Exception: the chooser's, annotated (the pipe is as it was).
        """
        auto = auto_of(pipe.schedule)
        if auto is None:
            return
        report = self.by_sizes.get(sizes)
        if report is None:
            micros = len(sizes)
            try:
                report = self.by_sizes[sizes] = choose(pipe, auto, inputs, target, loss_fn, micros)
            except Exception as exc:
                annotate(
                    exc,
                    f"mpstream: raised while schedule='auto' chose a schedule for {micros} "
                    f"micro-batches (measuring steps of the pipe unless Auto(costs=...) gives "
                    f"them); the pipe is as it was",
                )
                raise
        self.latest = report

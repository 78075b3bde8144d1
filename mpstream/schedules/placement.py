"""Which stages a schedule puts on one pipeline rank, checked against the devices.

Each built-in schedule needs one of three placements (the C++ core says
which, :data:`PLACEMENTS`):

- ``'stage'``: a rank per stage (``'gpipe'``, ``'1f1b'``, ``'zb_h1'``); the
  stages may sit on any devices.
- ``'round_robin'``: ``p`` ranks of ``v`` stages each, stage ``s`` on rank
  ``s mod p`` (``'interleaved_1f1b'``, ``'interleaved_zb'``,
  ``'looped_bfs'``).
- ``'v'``: ``p`` ranks of two stages in a V, stages ``s`` and ``2p - 1 - s``
  on rank ``s`` (``'zbv'``, ``'dualpipev'``).

The ranks come from the devices (``['cuda:0', 'cuda:1', 'cuda:0',
'cuda:1']`` is round-robin, ``['cuda:0', 'cuda:1', 'cuda:1', 'cuda:0']`` a
V) or, where the devices do not say (every stage on one device, the CPU),
from ``virtual_stages``. :func:`virtual_stages_for` checks a placement and
says what to pass when it does not fit.
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence

from .. import _ext
from .._words import count_of
from .orders import is_order

__all__ = [
    "PLACEMENTS",
    "placement_of",
    "virtual_stages_of",
    "v_stages_of",
    "virtual_stages_for",
    "check_virtual_stages",
    "rank_devices",
    "default_ranks",
]

_C = _ext.load()

#: Each built-in schedule's placement: ``'stage'``, ``'round_robin'`` or ``'v'``.
PLACEMENTS: dict[str, str] = dict(_C.schedule_placements())


def placement_of(schedule: object) -> str:
    """A schedule's placement; ``'stage'`` for an explicit order (its
    stages may sit anywhere) or an unknown name."""
    return PLACEMENTS.get(schedule, "stage") if isinstance(schedule, str) else "stage"


def _several(placement: str) -> str:
    names = [n for n, p in PLACEMENTS.items() if p == placement]
    return ", ".join(repr(n) for n in names)


def virtual_stages_of(
    devices: Sequence[Hashable],
    virtual_stages: int | None = None,
    schedule: str = "interleaved_1f1b",
) -> int:
    """How many stages each pipeline rank of a round-robin schedule holds.

    Stage ``s`` belongs to rank ``s mod (stages / v)``. Without
    ``virtual_stages``, ``v`` comes from a device list that repeats
    round-robin over ``p`` devices (``['cuda:0', 'cuda:1', 'cuda:0',
    'cuda:1']``: ``p = 2``, ``v = 2``).

    Args:
        devices: a device (or label) per stage.
        virtual_stages: stages per rank, if given.
        schedule: the schedule, named in errors.

    Returns:
        ``v``.

    Raises:
        ValueError: ``virtual_stages`` does not divide the stages, puts
            stages of one rank on different devices, or is missing where the
            devices do not say it (one device for every stage, or a
            placement that is not round-robin).
    """
    stages = len(devices)
    labels = list(dict.fromkeys(devices))
    listed = ", ".join(str(d) for d in devices)
    if virtual_stages is not None:
        v = check_virtual_stages(virtual_stages)
        if stages % v:
            raise ValueError(
                f"virtual_stages={v} does not divide the {count_of(stages, 'stage')} into ranks "
                f"of {v} stages each"
            )
        ranks = stages // v
        for s in range(ranks, stages):
            if devices[s] != devices[s % ranks]:
                raise ValueError(
                    f"virtual_stages={v} puts stages {s % ranks} and {s} on rank {s % ranks}, "
                    f"but they sit on different devices ({devices[s % ranks]}, {devices[s]}); "
                    f"place stage s on the device of stage s mod {ranks}"
                )
        return v
    if len(labels) == 1 and stages > 1:
        raise ValueError(
            f"every stage is on {labels[0]}: give virtual_stages= (stages per pipeline rank; "
            f"stage s belongs to rank s mod (stages / virtual_stages))"
        )
    ranks = len(labels)
    if stages % ranks or any(devices[s] != labels[s % ranks] for s in range(stages)):
        fits = [
            v
            for v in range(2, stages + 1)
            if stages % v == 0
            and all(devices[s] == devices[s % (stages // v)] for s in range(stages))
        ]
        advice = (
            f"place them round-robin ({', '.join(str(labels[s % ranks]) for s in range(stages))})"
            if stages % ranks == 0
            else f"use a device count that divides the {stages} stages"
        )
        if fits:
            advice += f", or give virtual_stages={fits[0]}"
        raise ValueError(
            f"{schedule} places stages round-robin over the devices (stage s on device "
            f"s mod {ranks}); got {listed}: {advice}"
        )
    return stages // ranks


def v_stages_of(
    devices: Sequence[Hashable], virtual_stages: int | None = None, schedule: str = "zbv"
) -> int:
    """Checks a V placement: ``2p`` stages, stages ``s`` and ``2p - 1 - s``
    on one device (rank ``s``).

    Args:
        devices: a device (or label) per stage.
        virtual_stages: 2 if given (a V holds two stages per rank); needed
            when every stage is on one device, where the devices do not say
            which stages form a rank.
        schedule: the schedule, named in errors.

    Returns:
        2, the stages per rank.

    Raises:
        ValueError: an odd number of stages, ``virtual_stages`` other than
            2, or missing on one device, or a placement that is not a V.
    """
    stages = len(devices)
    listed = ", ".join(str(d) for d in devices)
    if virtual_stages is not None and check_virtual_stages(virtual_stages) != 2:
        raise ValueError(
            f"{schedule} places two stages per rank in a V: virtual_stages must be 2 "
            f"(or None), got {virtual_stages}"
        )
    if stages % 2:
        raise ValueError(
            f"{schedule} places two stages per rank in a V (stages s and 2p - 1 - s on rank s): "
            f"it needs an even number of stages, got {stages} ({listed}); split the model into "
            f"{stages + 1}{f' or {stages - 1}' if stages > 1 else ''} stages"
        )
    p = stages // 2
    if len(set(devices)) == 1 and virtual_stages is None and stages > 1:
        raise ValueError(
            f"every stage is on {devices[0]}: give virtual_stages=2 for {schedule}'s V "
            f"(stage s on rank min(s, {stages - 1} - s))"
        )
    wrong = [s for s in range(p) if devices[s] != devices[stages - 1 - s]]
    if wrong:
        s = wrong[0]
        # Advise a V over every device given, not the first half mirrored:
        # ['cuda:0', 'cuda:0', 'cuda:1', 'cuda:1'] would become all cuda:0.
        labels = list(dict.fromkeys(devices))
        ranks = (
            [labels[r * len(labels) // p] for r in range(p)]
            if len(labels) <= p
            else list(devices[:p])
        )
        v_shape = [ranks[min(t, stages - 1 - t)] for t in range(stages)]
        raise ValueError(
            f"{schedule} places stages s and {stages - 1} - s on one device (a V: rank s holds "
            f"stage s on the way down and stage {stages - 1} - s on the way back), but stage "
            f"{s} is on {devices[s]} and stage {stages - 1 - s} on {devices[stages - 1 - s]} "
            f"(got {listed}); place them as {', '.join(str(d) for d in v_shape)}"
        )
    return 2


def virtual_stages_for(
    schedule: object, devices: Sequence[Hashable], virtual_stages: int | None
) -> int:
    """Stages per rank that ``schedule`` runs with on ``devices``.

    Args:
        schedule: a built-in schedule's name, or an explicit order.
        devices: a device (or label) per stage.
        virtual_stages: stages per rank, if given.

    Returns:
        ``v`` of a round-robin schedule, 2 for a V, 1 otherwise.

    Raises:
        ValueError: the devices (with ``virtual_stages``) do not fit the
            schedule's placement, or ``virtual_stages`` is given to a
            schedule of a rank per stage.
    """
    placement = placement_of(schedule)
    # An order (a tuple, or text) is named as one, not quoted action by action.
    name = schedule if isinstance(schedule, str) and not is_order(schedule) else "an explicit order"
    if placement == "round_robin":
        return virtual_stages_of(devices, virtual_stages, name)
    if placement == "v":
        return v_stages_of(devices, virtual_stages, name)
    if virtual_stages is not None:
        raise ValueError(
            f"virtual_stages={virtual_stages} applies to the schedules that place several "
            f"stages per rank ({_several('round_robin')}, {_several('v')}), not "
            f"{name!r}: drop virtual_stages, or "
            f"choose one of those"
        )
    return 1


def rank_devices(
    schedule: object, stages: int, devices: int, placement: str | None = None
) -> list[str]:
    """Device labels (``device0``, ...) placing ``stages`` stages on
    ``devices`` devices as ``schedule`` needs: contiguous runs of stages for
    a rank per stage (an order of actions too, unless ``placement`` says
    otherwise), round-robin, or a V whose ranks share the devices in
    contiguous runs.

    Args:
        schedule: a built-in schedule's name, or an order of actions.
        stages: how many stages.
        devices: how many devices they share.
        placement: for an order of actions written for several stages per
            rank, how its stages sit (``'round_robin'`` or ``'v'``, as the
            built-in schedules of that placement place theirs; default
            ``'stage'``, contiguous runs). A built-in schedule has its own.

    Raises:
        ValueError: the stages do not fit (round-robin: not a multiple of
            the devices; V: odd, or fewer ranks than devices), or
            ``placement`` is unknown or given for a built-in schedule.
    """
    own = placement_of(schedule)
    ordered = not isinstance(schedule, str) or is_order(schedule)
    if placement is not None:
        if placement not in ("stage", *PLACEMENTS.values()):
            raise ValueError(f"unknown placement {placement!r}: 'stage', 'round_robin' or 'v'")
        if not ordered and placement != own:
            raise ValueError(
                f"{schedule} places its stages as {own!r}, not {placement!r}: a placement is "
                f"given for an order of actions only"
            )
        own = placement
    if own == "round_robin":
        if stages % devices:
            how = "round-robin placement" if ordered else f"{schedule} places stages round-robin"
            do = "does" if stages == 1 else "do"
            raise ValueError(
                f"{how}: {count_of(stages, 'stage')} {do} not divide evenly over "
                f"{count_of(devices, 'device')}"
            )
        return [f"device{s % devices}" for s in range(stages)]
    if own == "v":
        if stages % 2 or stages // 2 < devices:
            how = "V placement" if ordered else f"{schedule} places two stages per rank in a V"
            need = "needs" if stages == 1 else "need"
            raise ValueError(
                f"{how}: {count_of(stages, 'stage')} {need} to be even and at least twice the "
                f"{count_of(devices, 'device')}"
            )
        ranks = stages // 2
        return [f"device{min(s, stages - 1 - s) * devices // ranks}" for s in range(stages)]
    return [f"device{s * devices // stages}" for s in range(stages)]


def default_ranks(
    schedule: object, stages: int, virtual_stages: int | None
) -> tuple[list[int], int | None]:
    """The rank of each stage where no devices are given (the simulator's
    and ``record_plan``'s default): one per stage, or as the schedule places
    them, in a V or round-robin over ``stages / virtual_stages`` ranks.

    Returns:
        The ranks, and ``virtual_stages`` as they imply it: 2 for a V (a V
        of two stages is one rank, whose devices cannot say it), else as
        given.

    Raises:
        ValueError: a round-robin schedule without ``virtual_stages`` (a
            rank per stage would be the schedule of one stage per rank,
            not what its name promises).
    """
    placement = placement_of(schedule)
    if placement == "round_robin" and virtual_stages is None:
        raise ValueError(
            f"schedule={schedule!r} places several stages per rank: give virtual_stages= "
            f"(stages per rank) or devices= (a label per stage, the ranks round-robin)"
        )
    if placement == "v" and stages % 2 == 0:
        ranks = [min(s, stages - 1 - s) for s in range(stages)]
        return ranks, 2 if virtual_stages is None else virtual_stages
    if placement == "round_robin" and virtual_stages and stages % virtual_stages == 0:
        return [s % (stages // virtual_stages) for s in range(stages)], virtual_stages
    # What does not fit (an odd V, a count virtual_stages does not divide)
    # is then refused by virtual_stages_for, naming what to pass.
    return list(range(stages)), virtual_stages


def check_virtual_stages(v: object) -> int:
    """Returns ``v`` as an int if it is a positive integer (numpy's too, as
    :class:`~mpstream.schedules.schedule.Schedule` takes them; not True as 1).

    Raises:
        ValueError: ``v`` is not a positive integer.
    """
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ValueError(f"virtual_stages must be a positive int, got {v!r}")
    return int(v)

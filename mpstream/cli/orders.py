"""``--order FILE``: an order of actions written by hand, for ``mpstream
schedules`` and ``mpstream trace``.

The file holds what ``Pipe(schedule=...)`` takes as one string: actions such
as ``F0m0 F1m0 B1m0 B0m0``, separated by whitespace or commas (``str()`` of
a training step's ``pipe.schedule_for(...)`` written out is one); a ``#``
starts a comment that runs to the end of its line. :func:`read` refuses a
file it cannot read or what is not an action; :func:`checked` then holds the
order against the run's stages and micro-batches with the library's own
check, whose error names the action, its stage and its step. :func:`placed`
holds it against the devices as ``--order-placement`` places its stages (an
order for several stages per device, as the round-robin and V schedules
place theirs). Each raises :class:`~.argtypes.UsageError`, naming
``--order`` and the file.
"""

from __future__ import annotations

from ..schedules import PLACEMENTS, Schedule, parse, rank_devices
from .argtypes import UsageError

__all__ = ["PLACEMENT_CHOICES", "read", "covered", "checked", "placed"]

#: ``--order-placement``'s values: the library's placements, a rank per
#: stage first (the default).
PLACEMENT_CHOICES = tuple(dict.fromkeys(["stage", *sorted(PLACEMENTS.values())]))


def read(path: str) -> tuple[str, ...]:
    """The actions of the order in the file at ``path``, as strings (each
    line's ``#`` comment left out).

    Raises:
        UsageError: the file cannot be read, or holds something that is not
            an action (or nothing).
    """
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except OSError as exc:
        raise UsageError(f"--order {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise UsageError(f"--order {path}: not a text file of actions") from None
    # A researcher's notes beside the actions (which stage waits, why).
    text = "\n".join(line.partition("#")[0] for line in text.splitlines())
    try:
        return tuple(str(a) for a in parse(text))
    except ValueError as exc:
        raise UsageError(f"--order {path}: {exc}") from None


def covered(order: tuple[str, ...]) -> tuple[int, int]:
    """The stages and micro-batches an order names: one more than the
    highest of each."""
    actions = parse(order)
    return 1 + max(a.stage for a in actions), 1 + max(a.micro for a in actions)


def checked(
    order: tuple[str, ...], path: str, stages: tuple[int, str], micros: tuple[int, str]
) -> None:
    """Checks that one host thread can issue ``order`` for a chain of stages
    over micro-batches, as a Pipe checks it.

    Args:
        order: the actions (:func:`read`).
        path: the file, named in errors.
        stages: the run's stage count, and where it comes from and what
            to do for an order of another count (``'--stages 4: drop it,
            or give an order for 4 stages'``).
        micros: the run's micro-batch count, and likewise.

    Raises:
        UsageError: ``--order PATH:`` and what does not fit: another count
            of stages or micro-batches than the run's, or the library's
            error (for an action out of order, the stage x step grid of
            the order with that action marked).
    """
    has = covered(order)
    names = (
        (("stage", "stages"), "stage 0", f"stages 0-{has[0] - 1}"),
        (("micro-batch", "micro-batches"), "m0", f"m0-m{has[1] - 1}"),
    )
    for (count, why), n, (what, one, several) in zip((stages, micros), has, names):
        if n != count:
            # Said here rather than by the library, whose advice is a Pipe's.
            raise UsageError(
                f"--order {path}: the order is for {n} {what[n > 1]} "
                f"({one if n == 1 else several}), but {why}"
            )
    try:
        Schedule(order, stages[0], micros[0], [False] * stages[0], backward=True)
    except ValueError as exc:
        raise UsageError(f"--order {path}: {exc}") from None


def placed(order: tuple[str, ...], path: str, placement: str, stages: int, devices: int) -> None:
    """Checks that the order's stages can sit on ``devices`` devices as
    ``placement`` places them.

    Args:
        order: the actions (:func:`read`).
        path: the file, named in errors.
        placement: ``--order-placement``.
        stages: the run's stage count (the order's).
        devices: ``--num-devices``.

    Raises:
        UsageError: ``--order PATH --order-placement P:``, why the stages
            do not fit, and the device counts that would.
    """
    try:
        rank_devices(order, stages, devices, placement)
    except ValueError as exc:
        fits = [n for n in range(1, stages + 1) if _fits(order, stages, n, placement)]
        advice = (
            f"give --num-devices {' or '.join(str(n) for n in fits)}"
            if fits
            else f"give an order for {stages + 1} stages"
        )
        raise UsageError(
            f"--order {path} --order-placement {placement}: {exc}; {advice}, or another "
            f"--order-placement"
        ) from None


def _fits(order: tuple[str, ...], stages: int, devices: int, placement: str) -> bool:
    try:
        rank_devices(order, stages, devices, placement)
    except ValueError:
        return False
    return True

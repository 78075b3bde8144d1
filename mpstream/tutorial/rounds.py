"""Round-robin timing of configurations held at once, in groups that fit.

The experiment builds every configuration first and times them in rounds,
one call each per round with the starting point rotating, so slow drift of
the machine (clocks, temperature, other load) spreads over all of them
instead of biasing their ratios. At large sizes every configuration does not
fit in device memory at once (CUDA graphs keep private memory pools: at
224x224 images and a batch of 256, an H200's 140 GiB held three graphed
pipelines and then ran out). A configuration that runs out of memory while
it is built or warmed up is dropped, the ones already held are timed as one
group and released, and building goes on in a new group with it first. Only
a configuration that does not fit alone is an error.

Ratios within a group are drift-free as before; across groups they are not,
so each measurement says its group.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

__all__ = ["NoRoom", "Timed", "round_robin"]

K = TypeVar("K", bound=Hashable)
M = TypeVar("M")


class NoRoom(Exception):
    """A configuration would not fit beside the others held (raised by a
    ``check``: a graphed stage whose capture ran out of memory runs eagerly
    instead of raising)."""


@dataclass
class Timed(Generic[K]):
    """What :func:`round_robin` measured.

    Attributes:
        times: seconds per call, per configuration, in round order.
        group: per configuration, the group it was timed in (0, 1, ...).
    """

    times: dict[K, list[float]] = field(default_factory=dict)
    group: dict[K, int] = field(default_factory=dict)

    @property
    def groups(self) -> int:
        """How many groups the configurations were timed in."""
        return len(set(self.group.values()))


def _release() -> None:
    """Frees what dropped configurations held: their reference cycles
    (an exception's frames hold the model) and the allocator's cached
    blocks, which a CUDA graph's private pool cannot use."""
    gc.collect()
    if torch.cuda.is_available():  # a no-op where CUDA was never used
        torch.cuda.empty_cache()


def round_robin(
    keys: Sequence[K],
    build: Callable[[K], M],
    call: Callable[[M], float],
    *,
    warmup: int,
    repeat: int,
    label: Callable[[K], str] = str,
    check: Callable[[K, M], None] | None = None,
    tick: Callable[[], None] | None = None,
    status: Callable[[str], None] | None = None,
) -> Timed[K]:
    """Times ``call`` on each configuration, ``repeat`` rounds after ``warmup``.

    Args:
        keys: the configurations, in building order.
        build: makes one configuration's model.
        call: one timed call; returns seconds.
        warmup: untimed calls per configuration, right after it is built.
        repeat: timed rounds.
        label: a configuration's name, for status and errors.
        check: called after the warm-up; raises :class:`NoRoom` when the
            configuration did not really fit (or any error to stop).
        tick: called after each call (progress bars).
        status: told what runs next.

    Returns:
        The times and each configuration's group.

    Raises:
        torch.cuda.OutOfMemoryError: a configuration does not fit in device
            memory even alone.
    """
    out: Timed[K] = Timed()
    pending = list(keys)
    group = 0
    while pending:
        held: dict[K, M] = {}
        while pending:
            key = pending[0]
            why = _try(key, build, call, warmup, label, check, tick, status, held)
            if why is not None:
                _release()
                if not held:
                    raise torch.cuda.OutOfMemoryError(
                        f"{label(key)} does not fit in device memory even alone: {why}. "
                        f"Use a smaller batch or images."
                    )
                break
            pending.pop(0)
        keys_held = list(held)
        for r in range(repeat):
            shift = r % len(keys_held)
            for key in keys_held[shift:] + keys_held[:shift]:
                if status is not None:
                    status(f"round {r + 1}/{repeat}: {label(key)}")
                out.times.setdefault(key, []).append(call(held[key]))
                if tick is not None:
                    tick()
        for key in keys_held:
            out.group[key] = group
        held.clear()
        _release()
        group += 1
    return out


def _try(
    key: K,
    build: Callable[[K], M],
    call: Callable[[M], float],
    warmup: int,
    label: Callable[[K], str],
    check: Callable[[K, M], None] | None,
    tick: Callable[[], None] | None,
    status: Callable[[str], None] | None,
    held: dict[K, M],
) -> str | None:
    """Builds and warms up ``key`` into ``held``; why it did not fit, if not."""
    try:
        model = build(key)
        for _ in range(warmup):
            if status is not None:
                status(f"warm-up: {label(key)}")
            call(model)
            if tick is not None:
                tick()
        if check is not None:
            check(key, model)
    except (torch.cuda.OutOfMemoryError, NoRoom) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    held[key] = model
    return None

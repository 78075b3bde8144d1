"""Round-robin timing of configurations held at once, in groups that fit.

The experiment builds every configuration first and times them in rounds,
one call each per round with the starting point rotating, so slow drift of
the machine (clocks, temperature, other load) spreads over all of them
instead of biasing their ratios. At large sizes every configuration does not
fit in device memory at once (CUDA graphs keep private memory pools: at
224x224 images and a batch of 256, an H200's 140 GiB held three graphed
pipelines and then ran out). A configuration that runs out of memory while
it is built or warmed up is dropped, the ones already held are timed as one
group and released, and building goes on in a new group with it first. A
configuration that does not fit even alone is an error, or, where the caller
asks (``skip_unfit``: a model only a pipeline can hold is the transformer
workload's point), left out and said (:attr:`Timed.unfit`).

Ratios within a group are drift-free as before; across groups they are not,
so each measurement says its group.

Rounds also tell how noisy they were (:func:`spread`, :func:`noisy`, from
:mod:`mpstream.observe.spread`): on a shared machine another process can
make one round of a configuration many times slower than the others, and a
ratio of means then says nothing; :func:`machine_load` is the host's load
before and after, said beside.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from ..observe.spread import MAX_CV, MAX_RANGE, Spread, noisy, spread

__all__ = [
    "NoRoom",
    "Timed",
    "round_robin",
    "says_out_of_memory",
    "out_of_memory",
    "Spread",
    "spread",
    "noisy",
    "machine_load",
    "load_line",
    "noise_lines",
    "NOISY",
    "MAX_CV",
    "MAX_RANGE",
]

#: What a table, a JSON and a figure say of a noisy measurement, and what to do.
NOISY = (
    f"noisy (rounds disagree: coefficient of variation above {MAX_CV:.0%} or slowest/fastest "
    f"above {MAX_RANGE:.1f}x): ratios with them may say more about the machine than about the "
    f"models; rerun on a quiet machine, or with more rounds (mpstream bench --repeat)"
)


def machine_load() -> dict[str, float | int | None]:
    """The host's 1-minute load average (None where the system does not
    say) and its CPU count: more load than CPUs means other work competed."""
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return {"load_1min": load, "cpus": os.cpu_count() or 1}


def noise_lines(
    noisy: Mapping[str, Spread], load: Mapping[str, Mapping[str, float | int | None]]
) -> list[str]:
    """What a table says below itself of noise: how many configurations
    were noisy, the worst one's rounds, what to do; and the host's load
    before and after (:func:`load_line`)."""
    lines = []
    if noisy:
        name, worst = max(noisy.items(), key=lambda kv: kv[1].max_over_min)
        lines.append(
            f"* {len(noisy)} measurement(s) {NOISY}. Worst: {name}, rounds "
            f"{worst.low:.3f}-{worst.high:.3f} s ({worst.max_over_min:.1f}x, cv {worst.cv:.0%})."
        )
    said = load_line(load)
    return lines + [said] if said else lines


def load_line(load: Mapping[str, Mapping[str, float | int | None]]) -> str:
    """One line on the host's load ``{"before": machine_load(), "after": ...}``;
    empty where the system did not say."""
    said = {when: v["load_1min"] for when, v in load.items() if v.get("load_1min") is not None}
    if not said:
        return ""
    cpus = next(iter(load.values()))["cpus"] or 1
    busy = any(float(v or 0) > float(cpus) for v in said.values())
    return (
        "machine load (1-minute average): "
        + ", ".join(f"{float(v or 0):.2f} {when}" for when, v in said.items())
        + f", on {cpus} CPUs"
        + ("; busier than its CPUs: other work competed with the timing" if busy else "")
    )


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
        unfit: with ``skip_unfit``, the configurations that did not fit in
            device memory even alone (not timed), each with why.
        interrupted: with ``interruptible``, whether an interrupt ended the
            timing early (``times`` then holds the rounds that ran: some
            configurations may have fewer, or none).
    """

    times: dict[K, list[float]] = field(default_factory=dict)
    group: dict[K, int] = field(default_factory=dict)
    unfit: dict[K, str] = field(default_factory=dict)
    interrupted: bool = False

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
    skip_unfit: bool = False,
    interruptible: bool = False,
) -> Timed[K]:
    """Times ``call`` on each configuration, ``repeat`` rounds after ``warmup``.

    Args:
        keys: the configurations, in building order.
        build: makes one configuration's model.
        call: one timed call; returns seconds.
        warmup: untimed calls per configuration, right after it is built.
        repeat: timed rounds (at least one).
        label: a configuration's name, for status and errors.
        check: called after the warm-up, and again after the timed rounds;
            raises :class:`NoRoom` when the configuration did not really fit
            (or any error to stop).
        tick: called after each call that counts (progress bars): a
            configuration's warm-up calls count once it fits.
        status: told what runs next.
        skip_unfit: a configuration that does not fit even alone, or whose
            build or warm-up raises, is left out and named in ``unfit`` with
            why (else it is an error, at once).
        interruptible: a ``KeyboardInterrupt`` (Ctrl-C, or a signal the
            caller turns into one), or an error raised because of one,
            ends the timing and returns what was timed, marked
            ``interrupted`` (else it propagates).

    Returns:
        The times and each configuration's group, and with ``skip_unfit``
        those that did not fit even alone.

    Raises:
        ValueError: ``repeat`` below one.
        torch.cuda.OutOfMemoryError: a configuration does not fit in device
            memory even alone (unless ``skip_unfit``).
        RuntimeError: ``check`` found no room only after the timed rounds
            (with no warm-up, a capture happens while timing).
    """
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    out: Timed[K] = Timed()
    try:
        _groups(
            list(keys), build, call, warmup, repeat, label, check, tick, status, skip_unfit, out
        )
    except BaseException as exc:
        if not (interruptible and _interrupt(exc)):
            raise
        out.interrupted = True
    if out.interrupted:  # out of the handler: the traceback's frames held the models
        last = max(out.group.values(), default=-1) + 1  # the group it stopped in
        for key in out.times:
            out.group.setdefault(key, last)
        _release()
    return out


def _interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``KeyboardInterrupt`` or was raised because of
    one: code the interrupt lands in may turn it into an error of its own
    (on Python 3.11 an import wraps it in a ``RuntimeError``, which
    transformers' lazy import wraps again; torch.export, unwinding it, fails
    an assertion), and the timing it ended must still come back."""
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if isinstance(e, KeyboardInterrupt):
            return True
        if id(e) not in seen:
            seen.add(id(e))
            stack += [x for x in (e.__cause__, e.__context__) if x is not None]
    return False


def _groups(
    pending: list[K],
    build: Callable[[K], M],
    call: Callable[[M], float],
    warmup: int,
    repeat: int,
    label: Callable[[K], str],
    check: Callable[[K, M], None] | None,
    tick: Callable[[], None] | None,
    status: Callable[[str], None] | None,
    skip_unfit: bool,
    out: Timed[K],
) -> None:
    """:func:`round_robin`'s groups, one after another, into ``out``."""
    group = 0
    while pending:
        held: dict[K, M] = {}
        while pending:
            key = pending[0]
            broke = None
            try:
                failed = _try(key, build, call, warmup, label, check, status, held)
            except Exception as e:
                # One configuration that cannot run must not cost the others'
                # times (a long GPU bench, a library version it was not
                # tried with); an interrupt still ends the run.
                if not skip_unfit or _interrupt(e):
                    raise
                first = (str(e).strip().splitlines() or [""])[0]
                broke = f"failed: {type(e).__name__}: {first}"
            if broke is not None:  # out of the handler: its frames held the model
                out.unfit[pending.pop(0)] = broke
                _release()
                if tick is not None:
                    for _ in range(warmup + repeat):
                        tick()
                continue
            if failed is not None:
                why = str(failed).splitlines()[0] if str(failed) else type(failed).__name__
                if not held and not skip_unfit:
                    raise torch.cuda.OutOfMemoryError(
                        f"{label(key)} does not fit in device memory even alone ({why}): "
                        f"use a smaller batch or smaller images"
                    ) from failed
                del failed  # its frames hold what the model allocated
                _release()
                if not held:
                    out.unfit[pending.pop(0)] = f"does not fit in device memory even alone ({why})"
                    if tick is not None:  # the calls it will not make: a bar ends full
                        for _ in range(warmup + repeat):
                            tick()
                    continue
                break
            pending.pop(0)
            if tick is not None:
                for _ in range(warmup):
                    tick()
        if not held:  # the last ones did not fit
            break
        _time_group(held, call, repeat, label, check, tick, status, out)
        for key in held:
            out.group[key] = group
        held.clear()
        _release()
        group += 1


def _time_group(
    held: dict[K, M],
    call: Callable[[M], float],
    repeat: int,
    label: Callable[[K], str],
    check: Callable[[K, M], None] | None,
    tick: Callable[[], None] | None,
    status: Callable[[str], None] | None,
    out: Timed[K],
) -> None:
    """Times one group round-robin into ``out``, then checks it again."""
    keys = list(held)
    for r in range(repeat):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            if status is not None:
                status(f"round {r + 1}/{repeat}: {label(key)}")
            seconds = call(held[key])  # first: an interrupted call leaves no empty entry
            out.times.setdefault(key, []).append(seconds)
            if tick is not None:
                tick()
    if check is None:
        return
    for key in keys:
        try:
            check(key, held[key])
        except NoRoom as e:
            raise RuntimeError(
                f"{label(key)}: {e} during the timed rounds, so its times are not what "
                f"they claim; warm each configuration up at least once"
            ) from e


def says_out_of_memory(text: str) -> bool:
    """Whether an error's words say the device ran out of memory (how CUDA
    and PyTorch's allocator put it, and cuBLAS or cuDNN failing to allocate
    a handle's workspace)."""
    lower = text.lower()
    return "out of memory" in lower or "status_alloc_failed" in lower


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` says the device ran out of memory: PyTorch's allocator
    error, or a CUDA call failing for it (a graph's instantiation, a
    library's workspace)."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and says_out_of_memory(str(e))


def _try(
    key: K,
    build: Callable[[K], M],
    call: Callable[[M], float],
    warmup: int,
    label: Callable[[K], str],
    check: Callable[[K, M], None] | None,
    status: Callable[[str], None] | None,
    held: dict[K, M],
) -> BaseException | None:
    """Builds and warms up ``key`` into ``held``; the error that says it did
    not fit, if it did not."""
    try:
        model = build(key)
        for _ in range(warmup):
            if status is not None:
                status(f"warm-up: {label(key)}")
            call(model)
        if check is not None:
            check(key, model)
    except NoRoom as e:
        return e
    except RuntimeError as e:
        if not out_of_memory(e):
            raise
        return e
    held[key] = model
    return None

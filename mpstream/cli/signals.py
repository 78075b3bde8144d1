"""SIGTERM read as Ctrl-C while a bench runs.

``timeout``, a batch system's time limit and a device lease end a run with
SIGTERM, which kills Python at once; read as a ``KeyboardInterrupt``, it
ends the timing as Ctrl-C does, and the bench still reports and saves what
it measured (:func:`~mpstream.tutorial.rounds.round_robin`'s
``interruptible``). The interrupt is raised wherever Python is when
the signal lands; where that swallows it (a garbage collector's callback
or a ``__del__`` prints "Exception ignored" and goes on), the check
:func:`terminate_as_interrupt` gives raises it again between timed calls.
While the results are written, SIGTERM is ignored (:func:`finish`): the
run is ending anyway, and an interrupt then would lose what it measured.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["INTERRUPTED", "terminate_as_interrupt", "saving", "finish"]

#: The exit status of a run ended early, as a shell reports one ended by Ctrl-C.
INTERRUPTED = 130


@contextlib.contextmanager
def terminate_as_interrupt(
    tick: Callable[[], None] = lambda: None,
) -> Iterator[Callable[[], None]]:
    """Within the block, SIGTERM raises ``KeyboardInterrupt``; the handler
    before it is put back after (off the main thread, where Python allows
    no handler, nothing changes).

    Args:
        tick: what to do after each timed call (a progress bar's update).

    Yields:
        ``tick``, then a check, to call after each timed call: it raises
        ``KeyboardInterrupt`` again once a SIGTERM has come, in case the
        first one was swallowed where it landed.
    """
    came: list[int] = []

    def interrupt(signum: int, frame: object) -> None:
        came.append(signum)
        raise KeyboardInterrupt

    def ticked() -> None:
        tick()
        if came:
            raise KeyboardInterrupt

    with _sigterm(interrupt):
        yield ticked


@contextlib.contextmanager
def saving() -> Iterator[None]:
    """Within the block, SIGTERM is ignored (``timeout``'s SIGKILL after
    ``--kill-after`` still ends a hang); the handler before it is put back
    after."""
    with _sigterm(signal.SIG_IGN):
        yield


def finish(
    results: Any,
    table: Callable[[Any], str],
    save: Callable[..., Sequence[Path]],
    out: Path,
    plots: bool,
) -> int:
    """Prints a bench's ``table`` and writes its files (``save``) with
    SIGTERM ignored, saying so where the run was cut short.

    Returns:
        The command's exit status: 0, or :data:`INTERRUPTED` for partial
        results (``results.interrupted``).
    """
    with saving():
        print(table(results))
        for path in save(results, out, plots=plots):
            print(f"wrote {path}")
    if results.interrupted:
        print("mpstream bench: interrupted: the results are partial", file=sys.stderr)
        return INTERRUPTED
    return 0


@contextlib.contextmanager
def _sigterm(handler: Any) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    before = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)

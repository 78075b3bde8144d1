"""SIGTERM read as Ctrl-C while a bench runs.

``timeout``, a batch system's time limit and a device lease end a run with
SIGTERM, which kills Python at once; read as a ``KeyboardInterrupt``, it
ends the timing as Ctrl-C does, and the bench still reports and saves what
it measured (:func:`~mpstream.tutorial.rounds.round_robin`'s
``interruptible``). While that is written, SIGTERM is ignored
(:func:`saving`): the run is ending anyway, and an interrupt then would
lose what it measured.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["INTERRUPTED", "terminate_as_interrupt", "saving"]

#: The exit status of a run ended early, as a shell reports one ended by Ctrl-C.
INTERRUPTED = 130


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises ``KeyboardInterrupt``; the handler
    before it is put back after (off the main thread, where Python allows
    no handler, nothing changes)."""
    with _sigterm(signal.default_int_handler):
        yield


@contextlib.contextmanager
def saving() -> Iterator[None]:
    """Within the block, SIGTERM is ignored (``timeout``'s SIGKILL after
    ``--kill-after`` still ends a hang); the handler before it is put back
    after."""
    with _sigterm(signal.SIG_IGN):
        yield


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

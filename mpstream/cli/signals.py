"""SIGTERM read as Ctrl-C while a bench runs.

``timeout``, a batch system's time limit and a device lease end a run with
SIGTERM, which kills Python at once; read as a ``KeyboardInterrupt``, it
ends the timing as Ctrl-C does, and the bench still reports and saves what
it measured (:func:`~mpstream.tutorial.rounds.round_robin`'s
``interruptible``).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["INTERRUPTED", "terminate_as_interrupt"]

#: The exit status of a run ended early, as a shell reports one ended by Ctrl-C.
INTERRUPTED = 130


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises ``KeyboardInterrupt``; the handler
    before it is put back after (off the main thread, where Python allows
    no handler, nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)

"""SIGTERM read as Ctrl-C while a bench runs (``cli.signals``)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from mpstream.cli.signals import saving, terminate_as_interrupt


def test_sigterm_raises_keyboard_interrupt_inside_and_nothing_after() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), terminate_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before


def test_off_the_main_thread_nothing_changes() -> None:
    seen: list[object] = []

    def run() -> None:
        with terminate_as_interrupt():  # signal.signal would raise ValueError here
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [signal.getsignal(signal.SIGTERM)]


def test_sigterm_is_ignored_while_results_are_saved() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with saving():
        os.kill(os.getpid(), signal.SIGTERM)  # would end the process by default
        written = True
    assert written and signal.getsignal(signal.SIGTERM) is before

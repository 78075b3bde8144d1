"""SIGTERM read as Ctrl-C while a bench runs (``cli.signals``)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from mpstream.cli.signals import saving, terminate_as_interrupt


def test_sigterm_raises_keyboard_interrupt_inside_and_nothing_after() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), terminate_as_interrupt() as check:
        check()  # nothing came yet
        os.kill(os.getpid(), signal.SIGTERM)
        check()  # reached only if a gc callback swallowed the interrupt
    assert signal.getsignal(signal.SIGTERM) is before


class _KilledInDel:
    """Sends SIGTERM from its ``__del__``, where the interrupt the handler
    raises is swallowed ("Exception ignored in ...")."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # a loop's jump runs the pending handler here
            pass


def test_an_interrupt_swallowed_where_it_landed_is_raised_again_by_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    swallowed: list[type[BaseException] | None] = []
    monkeypatch.setattr("sys.unraisablehook", lambda u: swallowed.append(u.exc_type))
    with terminate_as_interrupt() as check:
        killed = _KilledInDel()
        del killed  # the handler runs in __del__: its KeyboardInterrupt goes nowhere
        assert swallowed == [KeyboardInterrupt]
        with pytest.raises(KeyboardInterrupt):
            check()  # the bench's next tick stops it


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

"""The suite's own fixtures (tests/conftest.py): a test's objects frozen
out of the next tests' collections are still collected when garbage."""

from __future__ import annotations

import weakref

import pytest

_made: list[weakref.ref[object]] = []


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_test_leaves_a_cycle_behind() -> None:
    _made.append(weakref.ref(_Cycle()))


def test_an_earlier_test_s_cycle_is_collected() -> None:
    if not _made:
        pytest.skip("the test that leaves the cycle ran elsewhere (another worker)")
    # No gc.collect() here: the earlier test's objects are frozen by now.
    assert _made[0]() is None

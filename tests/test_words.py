"""A count and its noun (:mod:`mpstream._words`), and messages that read a
count of one: none says ``1 steps``."""

from __future__ import annotations

import pytest
from torch import nn

from mpstream import Pipe
from mpstream._words import count_of
from mpstream.observe.cost_args import copy_costs
from mpstream.schedules.placement import rank_devices


def test_count_of_says_one_in_the_singular() -> None:
    assert count_of(1, "step") == "1 step"
    assert [count_of(n, "step") for n in (0, 2)] == ["0 steps", "2 steps"]
    assert count_of(1, "micro-batch", "micro-batches") == "1 micro-batch"
    assert count_of(3, "micro-batch", "micro-batches") == "3 micro-batches"


def test_messages_of_a_count_of_one_read_in_the_singular() -> None:
    # Each read "1 modules", "1 entries", "1 stages" before.
    with pytest.raises(TypeError, match=r"got a list of 1 module: wrap"):
        Pipe([nn.Linear(2, 2)], chunks=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"copy_times needs 1 entry \(one per boundary\)"):
        copy_costs([1.0, 2.0], 2, True)
    with pytest.raises(ValueError, match=r"1 stage does not divide evenly over 2 devices"):
        rank_devices("interleaved_1f1b", 1, 2)
    with pytest.raises(ValueError, match=r"1 stage needs to be even and at least twice the 1 "):
        rank_devices("zbv", 1, 1)

"""A Pipe's configuration: what ``schedule_for`` returns for a run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpstream import Pipe


def test_schedule_for_reads_a_device_given_as_a_string() -> None:
    # "cpu" was compared with the stages' torch.devices, found on none, and
    # read as a batch off the first stage's device: an input copy per
    # micro-batch that train_step on this batch never issues.
    pipe = Pipe(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
        chunks=2,
        balance=[1, 1],
        devices=["cpu", "cpu"],
        schedule="1f1b",
    )
    cpu = torch.device("cpu")
    expected = pipe.schedule_for(2, cpu, training_step=True, target_device=cpu)
    given = pipe.schedule_for(2, "cpu", training_step=True, target_device="cpu")
    assert [t.kind.label for t in given.tasks] == [t.kind.label for t in expected.tasks]
    assert "copy" not in {t.kind.label for t in given.tasks}


def test_schedule_report_of_a_user_order_names_it_briefly() -> None:
    # It quoted the tuple of every action.
    order = "F0m0 F1m0 F0m1 B1m0 B0m0 F1m1 B1m1 B0m1"
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=2, balance=[1, 1],
                devices=["cpu", "cpu"], schedule=order)  # fmt: skip
    with pytest.raises(
        ValueError, match=r"^the schedule is your order of 8 actions, chosen by you"
    ):
        pipe.schedule_report()

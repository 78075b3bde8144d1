"""The schedule of one run of a pipe (mpstream.pipe.run_schedule), as
``Pipe.schedule_for`` returns it."""

from __future__ import annotations

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


def test_each_kind_of_run_s_schedule_is_built_once() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=2, balance=[1, 1],
                devices=["cpu", "cpu"], schedule="1f1b")  # fmt: skip
    forward = pipe.schedule_for(2, "cpu")
    assert pipe.schedule_for(2, torch.device("cpu")) is forward
    step = pipe.schedule_for(2, "cpu", training_step=True)
    assert step is not forward and str(step) != str(forward)
    assert pipe.schedule_for(2, "cpu", training_step=True) is step
    assert pipe.schedule_for(3, "cpu") is not forward

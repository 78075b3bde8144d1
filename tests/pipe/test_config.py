"""A Pipe's configuration: ``virtual_stages`` checked when set and against
the schedule at the step, and what ``schedule_report`` says."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from mpstream import Pipe


def test_schedule_report_of_a_user_order_names_it_briefly() -> None:
    # It quoted the tuple of every action.
    order = "F0m0 F1m0 F0m1 B1m0 B0m0 F1m1 B1m1 B0m1"
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=2, balance=[1, 1],
                devices=["cpu", "cpu"], schedule=order)  # fmt: skip
    with pytest.raises(
        ValueError, match=r"^the schedule is your order of 8 actions, chosen by you"
    ):
        pipe.schedule_report()


def test_virtual_stages_set_for_another_schedule_is_refused_at_the_step() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), chunks=2, schedule="1f1b")
    pipe.virtual_stages = 2
    x = torch.randn(4, 2)
    with pytest.raises(ValueError, match="virtual_stages=2 applies to the schedules that place"):
        pipe.train_step(x, x, nn.functional.mse_loss)
    pipe.virtual_stages = None
    assert pipe.train_step(x, x, nn.functional.mse_loss).dim() == 0


def test_auto_refuses_a_virtual_stages_that_fits_no_schedule() -> None:
    # As a named schedule of several stages per rank would, rather than
    # dropping it and choosing among the others (3 divides no 2 stages).
    layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"schedule='auto' with virtual_stages=3: no "):
        Pipe(layers, chunks=2, devices=["cpu"] * 2, schedule="auto", virtual_stages=3)
    pipe = Pipe(layers, chunks=2, devices=["cpu"] * 2, schedule="auto")
    pipe.virtual_stages = 3
    x = torch.randn(4, 2)
    with pytest.raises(ValueError, match="fix virtual_stages, or drop it"):
        pipe.train_step(x, x, nn.functional.mse_loss)
    assert all(p.grad is None for p in pipe.parameters())


@pytest.mark.parametrize("virtual", [0, -1, "2", True, 2.0])
@pytest.mark.parametrize("schedule", ["auto", "interleaved_1f1b", "gpipe"])
def test_a_virtual_stages_that_is_no_positive_int_is_refused_when_set(
    virtual: object, schedule: str
) -> None:
    # As chunks, split_size and checkpoint are: at once, whatever the
    # schedule, and the pipe keeps its value.
    layers = nn.Sequential(*(nn.Linear(2, 2) for _ in range(4)))
    match = rf"virtual_stages must be a positive int, got {re.escape(repr(virtual))}"
    with pytest.raises(ValueError, match=match):
        Pipe(layers, chunks=2, devices=["cpu"] * 4, schedule=schedule, virtual_stages=virtual)  # type: ignore[arg-type]
    kept = 2 if schedule == "interleaved_1f1b" else None  # on one device it needs one
    pipe = Pipe(layers, chunks=2, devices=["cpu"] * 4, schedule=schedule, virtual_stages=kept)
    with pytest.raises(ValueError, match=match):
        pipe.virtual_stages = virtual  # type: ignore[assignment]
    assert pipe.virtual_stages == kept
    x = torch.randn(4, 2)
    assert pipe.train_step(x, x, nn.functional.mse_loss).dim() == 0

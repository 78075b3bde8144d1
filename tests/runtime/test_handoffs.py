"""The user's own loop over graphed stages (``pipe(x)``, ``loss.backward()``):
a graphed stage reads the output buffer of a replayed producer on its device
in place and writes the gradient into the producer's output-gradient buffer
(where it is the value's only reader), equal to the plain model; replays
emulated on the CPU (see tests/runtime/graphed/test_stages.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.runtime import handoffs, replay_autograd
from mpstream.runtime.graphed import Emulated
from tests.helpers import Ops, mlp
from tests.models import Fan
from tests.runtime.graphed.pairs import WIDTHS
from tests.runtime.graphed.test_grads import Silent
from tests.runtime.test_replayed import calls

VIRTUAL = {"virtual_stages": 2, "balance": [2, 2, 2, 2], "devices": ["cpu"] * 4}


def in_place(pipe: Pipe, producer: int, reader: int) -> tuple[bool, bool]:
    """Whether every call of ``reader`` reads an output buffer of ``producer``'s
    in place, and whether every one writes its input gradient into one."""
    outs = {c.static_out[0].data_ptr() for c in calls(pipe, producer)}
    grads = {id(g) for c in calls(pipe, producer) for g in c.static_grad_out}
    readers = calls(pipe, reader)
    assert readers
    read = all(c.static_in[0].data_ptr() in outs for c in readers)
    written = all(c.static_grad_in and id(c.static_grad_in[0]) in grads for c in readers)
    return read, written


def same_as_plain(
    model: nn.Module, pipe: Pipe, *args: Any, forwards: int = 1, input_grad: bool = True
) -> None:
    """``forwards`` forwards (each input scaled apart) then one backward, in
    the pipe and in the plain model: outputs, parameter and input gradients."""
    grads = []
    for net in (model, pipe):
        net.zero_grad()
        x = args[0].clone().requires_grad_(input_grad)
        outs = [net(x * (k + 1), *args[1:]) for k in range(forwards)]
        sum((o * o).sum() for o in outs).backward()
        grads.append((outs, x.grad, [p.grad for p in net.parameters()]))
    torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize(
    ("schedule", "extra"),
    [("gpipe", {}), ("1f1b", {}), ("zb_h1", {}), ("interleaved_1f1b", VIRTUAL)],
)
@pytest.mark.parametrize("split_size", [2, 3])  # 10 rows: the last micro-batch smaller with 3
def test_the_users_loop_reads_the_producer_s_buffers_in_place(
    schedule: str, extra: dict[str, Any], split_size: int
) -> None:
    model = mlp(WIDTHS)
    kwargs: dict[str, Any] = {"balance": [4, 4], "devices": ["cpu"] * 2, **extra}
    pipe = Pipe(copy.deepcopy(model), graphs=Emulated(), split_size=split_size,
                schedule=schedule, **kwargs)  # fmt: skip
    x = torch.randn(10, WIDTHS[0], dtype=torch.float64)
    for _ in range(2):  # capture, then replay
        same_as_plain(model, pipe, x)
    same_as_plain(model, pipe, x, forwards=2)  # a second forward before the backward
    for s in range(1, len(pipe.partitions)):
        assert in_place(pipe, s - 1, s) == (True, True)


def test_the_hand_off_copies_are_gone_from_the_users_loop() -> None:
    counts = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = Pipe(mlp(WIDTHS), graphs=Silent(), chunks=4, schedule=schedule,
                    balance=[4, 4], devices=["cpu"] * 2)  # fmt: skip
        x = torch.randn(8, WIDTHS[0], dtype=torch.float64)
        y = torch.randn(8, WIDTHS[-1], dtype=torch.float64)
        for _ in range(2):
            nn.functional.mse_loss(pipe(x), y).backward()
        with Ops() as seen:
            nn.functional.mse_loss(pipe(x), y).backward()
        counts[schedule] = seen.ops["copy_"]
    # Per micro-batch: the first stage's input copied in, the loss's gradient
    # into the last stage's buffer; no longer stage 0's output into stage 1's
    # inputs, nor stage 1's input gradient into stage 0's buffer.
    assert counts == {"gpipe": 2 * 4, "1f1b": 2 * 4}


@pytest.mark.parametrize("chunks", [1, 3])
def test_a_value_several_stages_read_is_read_in_place_its_gradient_summed(chunks: int) -> None:
    # Fan: stage 0's output read by every later stage (its gradient goes
    # the usual way, summed by autograd), checkpointed micro-batches.
    model = Fan().double()
    pipe = Pipe(copy.deepcopy(model), graphs=Emulated(), split_points=["a", "b", "c"],
                devices=["cpu"] * 4, chunks=chunks, checkpoint="except_last")  # fmt: skip
    x = torch.randn(6, 4, dtype=torch.float64)
    for scale in (2.0, 2.0, 3.0):
        same_as_plain(model, pipe, x, scale)
    same_as_plain(model, pipe, x, 2.0, forwards=2)
    assert in_place(pipe, 0, 1) == (True, False)


@pytest.mark.parametrize(
    ("case", "want"),
    [
        ("force_copies", (False, False)),  # a copy task between the stages
        ("frozen first stage", (False, False)),  # no Replay node: its outputs cloned
        ("frozen second stage", (True, True)),  # its input still needs a gradient
    ],
)
def test_what_is_copied_or_frozen_still_equals_the_plain_model(
    case: str, want: tuple[bool, bool]
) -> None:
    model = mlp(WIDTHS)
    if case != "force_copies":
        for p in model[:4].parameters() if case == "frozen first stage" else model[4:].parameters():
            p.requires_grad_(False)
    pipe = Pipe(copy.deepcopy(model), graphs=Emulated(), chunks=3, balance=[4, 4],
                devices=["cpu"] * 2, force_copies=case == "force_copies")  # fmt: skip
    x = torch.randn(9, WIDTHS[0], dtype=torch.float64)
    for _ in range(2):
        same_as_plain(model, pipe, x, input_grad=case != "frozen first stage")
    assert in_place(pipe, 0, 1) == want


class Pair(nn.Module):
    """Split at ``r``: the first stage hands on two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Linear(4, 6)
        self.q = nn.Linear(4, 6)
        self.r = nn.Linear(6, 3)
        self.s = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.tanh(self.p(x)), torch.tanh(self.q(x))
        out: torch.Tensor = self.r(a) + self.s(b)
        return out


def test_a_multi_output_stage_s_layout_is_found_once_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Which output each static output belongs to is fixed per call: not
    # rebuilt for every micro-batch of every run.
    counted: list[object] = []
    counts = handoffs.leaf_counts

    def counting(call: Any, outputs: int) -> list[int]:
        counted.append(call)
        return counts(call, outputs)

    monkeypatch.setattr(handoffs, "leaf_counts", counting)
    model = Pair().double()
    pipe = Pipe(copy.deepcopy(model), graphs=Emulated(), split_points=["r"],
                devices=["cpu"] * 2, chunks=3)  # fmt: skip
    x = torch.randn(6, 4, dtype=torch.float64)
    for _ in range(3):
        same_as_plain(model, pipe, x)
    # Only a stage with several outputs asks (so it was asked at all).
    made = calls(pipe, 0)
    assert counted and len(counted) == len(made) and set(map(id, counted)) == set(map(id, made))


def test_a_call_s_layout_is_found_once_for_every_step_of_both_loops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Where each static output sits, and its gradient, is fixed per call:
    # a training step's tasks read it (per micro-batch) without building it
    # again for every step.
    built: list[object] = []
    real = handoffs.Layout.__init__

    def counting(self: handoffs.Layout, call: Any, outputs: int) -> None:
        built.append(call)
        real(self, call, outputs)

    monkeypatch.setattr(handoffs.Layout, "__init__", counting)
    model = Pair().double()
    eager, pipe = (
        Pipe(copy.deepcopy(model), graphs=graphs, split_points=["r"], devices=["cpu"] * 2,
             chunks=3)
        for graphs in (False, Emulated())
    )  # fmt: skip
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    for _ in range(3):
        for net in (eager, pipe):
            net.zero_grad()
            net.train_step(x, y, nn.MSELoss())
        torch.testing.assert_close([p.grad for p in pipe.parameters()],
                                   [p.grad for p in eager.parameters()])  # fmt: skip
        same_as_plain(model, pipe, x)
    made = calls(pipe, 0) + calls(pipe, 1)
    assert built and len(built) == len(set(map(id, built))) <= len(made)
    assert set(map(id, built)) <= set(map(id, made))


def test_a_replay_of_tensor_arguments_walks_them_only_to_find_handoffs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Replayed calls of a flat tuple of tensors take the arguments as they
    # are; only a reader of handoffs walks them (for their sources).
    walked: list[object] = []
    real = replay_autograd.leaves

    def counted(value: Any) -> tuple[list[Any], Any]:
        walked.append(value)
        return real(value)

    model = mlp(WIDTHS)
    pipe = Pipe(copy.deepcopy(model), graphs=Emulated(), balance=[4, 4], devices=["cpu"] * 2,
                chunks=3)  # fmt: skip
    x = torch.randn(6, WIDTHS[0], dtype=torch.float64)
    same_as_plain(model, pipe, x)  # captures
    monkeypatch.setattr(replay_autograd, "leaves", counted)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
    assert walked == []
    same_as_plain(model, pipe, x)
    assert len(walked) == 3  # stage 1, per micro-batch: it reads stage 0's handoffs


class HandsScaled(nn.Module):
    """Hands on a plain value before its tensor: (2.0, y)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 6, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> tuple[float, torch.Tensor]:
        return 2.0, torch.tanh(self.layer(x))


class TakesScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 3, dtype=torch.float64)

    def forward(self, k: float, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layer(y) * k
        return out


def test_a_reader_of_a_plain_value_before_the_tensor_reads_the_tensor_in_place() -> None:
    # The sources of a stage's arguments are per tensor among their leaves:
    # the plain value takes no place among them.
    model = nn.Sequential(nn.Linear(4, 6, dtype=torch.float64), HandsScaled(), TakesScaled())
    pipe = Pipe(copy.deepcopy(model), graphs=Emulated(), balance=[2, 1], devices=["cpu"] * 2,
                chunks=3)  # fmt: skip
    x = torch.randn(6, 4, dtype=torch.float64)

    def plain(v: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model[2](*model[1](model[0](v)))  # the tuple spread, as the pipe does
        return out

    for _ in range(3):  # capture, then replay
        results = []
        for net, run in ((model, plain), (pipe, pipe)):
            net.zero_grad()
            v = x.clone().requires_grad_()
            out = run(v)
            (out * out).sum().backward()
            results.append((out, v.grad, [p.grad for p in net.parameters()]))
        torch.testing.assert_close(results[1], results[0])
    assert in_place(pipe, 0, 1) == (True, True)

"""A call of a pipe made from another stream than the previous call's waits
on that stream first (runtime/callers.py), checked here on stand-in CUDA
streams; on a GPU, tests/cuda/test_streams.py shows the race it closes (a
graphed pipe's outputs and the gradients read by the previous caller)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.runtime import callers, forward, training
from mpstream.runtime.callers import CallerStreams

CUDA = [torch.device("cuda", 0), torch.device("cuda", 1)]


@dataclass
class Device:
    """What the stand-ins see: each device's current stream, by name, and
    every wait issued, as (device, waiting stream, stream waited on)."""

    current: dict[int, str] = field(default_factory=lambda: {0: "A", 1: "A"})
    waits: list[tuple[int, str, str]] = field(default_factory=list)
    capturing: bool = False


class FakeStream:
    """A CUDA stream stand-in: equal by device and name, as torch's are by id."""

    def __init__(self, index: int, name: str, device: Device) -> None:
        self.index, self.name, self.log = index, name, device

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and (other.index, other.name) == (
            self.index,
            self.name,
        )

    __hash__ = None  # type: ignore[assignment]

    def wait_stream(self, other: FakeStream) -> None:
        self.log.waits.append((self.index, self.name, other.name))


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> Iterator[Device]:
    state = Device()

    def current_stream(d: torch.device) -> FakeStream:
        assert d.index is not None
        return FakeStream(d.index, state.current[d.index], state)

    monkeypatch.setattr(callers, "current_stream", current_stream)
    monkeypatch.setattr(callers, "capturing", lambda devices: state.capturing)
    yield state


def test_calls_from_the_same_streams_wait_on_nothing(device: Device) -> None:
    streams = CallerStreams(CUDA)
    for _ in range(3):
        streams.follow()
    assert device.waits == []


def test_a_call_from_another_stream_waits_on_the_previous_calls_there(device: Device) -> None:
    streams = CallerStreams(CUDA)
    streams.follow()  # the first call: nothing before it
    device.current[0] = "B"
    streams.follow()
    assert device.waits == [(0, "B", "A")]  # only where the stream changed
    device.current[1] = "C"
    streams.follow()
    streams.follow()
    assert device.waits == [(0, "B", "A"), (1, "C", "A")]
    device.current[0] = "A"  # back: A waits on B, the latest call's
    streams.follow()
    assert device.waits[-1] == (0, "A", "B")


def test_a_captured_call_neither_waits_nor_becomes_the_latest(device: Device) -> None:
    streams = CallerStreams(CUDA)
    streams.follow()
    device.current[0], device.capturing = "capture", True
    streams.follow()
    assert device.waits == []
    device.current[0], device.capturing = "B", False
    streams.follow()
    assert device.waits == [(0, "B", "A")]  # after the one before the capture


def test_host_devices_have_no_streams_to_follow(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(d: torch.device) -> Any:
        raise AssertionError(f"asked for {d}'s current stream")

    monkeypatch.setattr(callers, "current_stream", refuse)
    streams = CallerStreams([torch.device("cpu")])
    streams.follow()
    assert streams.latest is None


def test_every_call_follows_its_caller_before_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """pipe(x) and train_step both: the wait comes before the run issues
    anything (and a step's failure snapshot copies anything)."""
    events: list[str] = []
    monkeypatch.setattr(CallerStreams, "follow", lambda self: events.append("follow"))
    for module in (forward, training):
        run = module.execute

        def logged(*args: Any, _run: Any = run, **kwargs: Any) -> None:
            events.append("run")
            _run(*args, **kwargs)

        monkeypatch.setattr(module, "execute", logged)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    pipe = Pipe(copy.deepcopy(model), balance=[2, 1], chunks=2)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    torch.testing.assert_close(pipe(x), model(x))
    assert events == ["follow", "run"]
    pipe.train_step(x, y, nn.MSELoss())
    assert events == ["follow", "run"] * 2


def test_each_pipe_follows_its_own_callers() -> None:
    """A copy of a pipe rebuilds its scheduler, and with it whom it follows."""
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), balance=[1, 1], chunks=2)
    other = copy.deepcopy(pipe)
    assert other.scheduler.callers is not pipe.scheduler.callers

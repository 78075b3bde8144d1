"""A call of a pipe made from another stream than the previous call's waits
on that stream first, and on the io stream where a backward copied an
input's gradient to another GPU (runtime/callers.py), checked here on
stand-in CUDA streams; on a GPU, tests/cuda/test_streams.py shows the races
they close (a graphed pipe's outputs, the gradients read by the previous
caller, a graphed stage's input-gradient buffer)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.runtime import callers, forward, scheduler, training
from mpstream.runtime import copy as copies
from mpstream.runtime.callers import CallerStreams
from mpstream.runtime.scheduler import EventScheduler
from mpstream.runtime.transfer import GradLink

CUDA = [torch.device("cuda", 0), torch.device("cuda", 1)]


@dataclass
class Device:
    """What the stand-ins see: each device's current stream, by name, and
    every wait issued, as (device, waiting stream, stream waited on); a wait
    raises ``fail`` instead while it is set (a broken device, a Ctrl-C)."""

    current: dict[int, str] = field(default_factory=lambda: {0: "A", 1: "A"})
    waits: list[tuple[int, str, str]] = field(default_factory=list)
    capturing: bool = False
    fail: BaseException | None = None


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
        if self.log.fail is not None:
            raise self.log.fail
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
    anything (and a step's failure snapshot copies anything), after the
    devices are checked (once a call)."""
    events: list[str] = []
    monkeypatch.setattr(CallerStreams, "follow", lambda self: events.append("follow"))
    monkeypatch.setattr(EventScheduler, "check_device", lambda self: events.append("check"))
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
    assert events == ["check", "follow", "run"]
    pipe.train_step(x, y, nn.MSELoss())
    assert events == ["check", "follow", "run"] * 2


@pytest.mark.parametrize("path", ["forward", "train_step"])
def test_a_device_an_earlier_call_broke_is_named_before_the_waits_meet_it(
    path: str, device: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call from another stream, after a failed call's end met a sticky
    device error: the wait on the previous caller's stream would raise
    CUDA's own error; the devices' check says what happened first."""
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), balance=[1, 1], chunks=2)
    sched = pipe.scheduler
    sched.callers = CallerStreams(CUDA)  # stand-in CUDA caller streams
    sched.callers.follow()  # the failed call, from stream A
    sched.device_error = "RuntimeError: CUDA error: an illegal memory access was encountered"
    monkeypatch.setattr(scheduler, "device_failure", lambda d: "cuda:0 still fails (same)")
    device.current[0] = "B"
    device.fail = RuntimeError("CUDA error: an illegal memory access was encountered")
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    with pytest.raises(RuntimeError, match="ending it raised .*; cuda:0 still fails .* sticky"):
        pipe(x) if path == "forward" else pipe.train_step(x, y, nn.MSELoss())


def test_each_pipe_follows_its_own_callers() -> None:
    """A copy of a pipe rebuilds its scheduler, and with it whom it follows."""
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), balance=[1, 1], chunks=2)
    other = copy.deepcopy(pipe)
    assert other.scheduler.callers is not pipe.scheduler.callers


def test_a_read_noted_by_a_backward_is_waited_on_by_the_next_call_once(device: Device) -> None:
    """The gradient of an input on another GPU is read on the io stream,
    after which the next call (same caller stream, no input copy) waits on it."""
    streams = CallerStreams(CUDA)
    streams.follow()
    streams.note_read(CUDA[1], FakeStream(1, "io", device))
    streams.follow()
    assert device.waits == [(1, "A", "io")]
    streams.follow()
    assert device.waits == [(1, "A", "io")]  # read once, waited on once


def test_a_read_noted_stays_owed_when_the_wait_on_it_is_interrupted(device: Device) -> None:
    """A Ctrl-C as the call's stream waits on the read: the call fails, and
    the next call waits on it (as on one noted meanwhile, which is newer)."""
    streams = CallerStreams(CUDA)
    streams.follow()
    streams.note_read(CUDA[0], FakeStream(0, "io", device))
    device.fail = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        streams.follow()
    streams.note_read(CUDA[1], FakeStream(1, "io", device))
    device.fail = None
    streams.follow()
    assert sorted(device.waits) == [(0, "A", "io"), (1, "A", "io")]


def test_a_noted_read_waits_for_a_call_outside_a_capture(device: Device) -> None:
    streams = CallerStreams(CUDA)
    streams.follow()
    streams.note_read(CUDA[0], FakeStream(0, "io", device))
    device.current[0], device.capturing = "capture", True
    streams.follow()
    assert device.waits == []
    device.current[0], device.capturing = "B", False
    streams.follow()
    assert device.waits == [(0, "B", "A"), (0, "B", "io")]


def test_a_read_on_a_host_device_notes_nothing(device: Device) -> None:
    streams = CallerStreams([torch.device("cpu"), CUDA[0]])
    streams.note_read(torch.device("cpu"), FakeStream(0, "io", device))
    assert streams.reads == {}


class _Stub:
    """A CUDA gradient stand-in for Copy.backward: only what it asks of one."""

    is_cuda = True
    device = CUDA[0]


@pytest.mark.parametrize(
    ("source", "linked", "noted"),
    [("cuda:1", False, True), ("cpu", True, False), ("cuda:0", False, False)],
    ids=["another GPU", "host, waited for there", "the stage's device"],
)
def test_the_input_gradient_copy_notes_its_read_for_the_next_call(
    source: str, linked: bool, noted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copy.backward of the pipeline's input: a graphed stage's gradient is
    its buffer, which the copy to another GPU reads on the io stream, outside
    every task of the next call; the host's copy is waited for on the host
    (HostWait), and an input on the stage's device gets the gradient itself."""
    state = Device()
    io = FakeStream(0, "io", state)
    grad = _Stub()
    monkeypatch.setattr(copies, "current_stream", lambda d: io)
    monkeypatch.setattr(copies, "to_host", lambda g, d, link: g if d == g.device else object())
    sched = SimpleNamespace(devices=CUDA, callers=CallerStreams(CUDA))
    route = SimpleNamespace(sched=sched, stage=-1, peer=0, links=[GradLink()] if linked else None)
    ctx = SimpleNamespace(route=route, k=0, src_device=torch.device(source))
    copies.Copy.backward(ctx, grad)  # type: ignore[arg-type]
    assert sched.callers.reads == ({0: io} if noted else {})

"""Host transfers: staging through pinned buffers, asynchronous gradients back.

The device behaviour (no host synchronization, the io stream) is tested in
tests/cuda/test_hot_path.py and test_streams.py; here the logic, with the
``meta`` device standing in for a GPU and fake events for CUDA's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpstream.runtime import forward, training, transfer
from mpstream.runtime.microbatch import scatter
from mpstream.runtime.scheduler import EventScheduler
from mpstream.runtime.transfer import (
    GradLink,
    HostWait,
    host_staging,
    micro_staging,
    to_device,
    to_host,
)
from mpstream.runtime.worker import Worker
from mpstream.schedules.schedule import Schedule


def test_staging_fills_the_buffer_and_moves_it() -> None:
    x = torch.arange(6.0).reshape(3, 2)
    buffer = torch.zeros(3, 2)
    moved = to_device(x, torch.device("meta"), buffer)
    assert moved.device.type == "meta" and moved.shape == (3, 2)
    torch.testing.assert_close(buffer, x)


def test_nothing_moves_on_its_own_device() -> None:
    x = torch.ones(2)
    assert to_device(x, torch.device("cpu")) is x
    assert to_host(x, torch.device("cpu"), GradLink()) is x


def test_no_staging_without_a_cuda_destination() -> None:
    assert host_staging(torch.ones(4, 2), torch.device("cpu")) is None
    assert host_staging((torch.ones(4, 2), torch.ones(4)), torch.device("meta")) is None


class FakeEvent:
    def __init__(self) -> None:
        self.waited = 0

    def synchronize(self) -> None:
        self.waited += 1


def test_host_wait_waits_for_the_gradient_copy_once() -> None:
    link = GradLink()
    x = torch.randn(3, 2, requires_grad=True)
    (y,) = HostWait.apply(link, x)
    assert y.data_ptr() == x.data_ptr() and y.grad_fn is not None
    event = FakeEvent()
    link.event = event  # type: ignore[assignment]
    (y * 2).sum().backward()
    assert event.waited == 1 and link.event is None
    torch.testing.assert_close(x.grad, torch.full((3, 2), 2.0))


def test_host_wait_passes_integer_tensors_through() -> None:
    link = GradLink()
    x, index = torch.randn(2, requires_grad=True), torch.arange(2)
    y, i = HostWait.apply(link, x, index)
    assert not i.requires_grad and i.dtype == torch.int64
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(2))


def test_staging_buffers_split_like_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call's pinned buffers (one per leaf, None for a leaf needing none)
    are split into micro-batches as scatter splits the batch."""
    buffer = torch.zeros(7, 2)
    monkeypatch.setattr(transfer, "host_staging", lambda value, device: (buffer, None))
    batch = (torch.randn(7, 2), torch.arange(7))
    staging = [s for s in micro_staging(batch, torch.device("cpu"), None, 3) or () if s]
    assert [s[1] for s in staging] == [None] * 3
    slices = [s[0] for s in staging if s[0] is not None]
    assert [len(t) for t in slices] == [3, 3, 1]
    assert [t.data_ptr() for t in slices] == [buffer[i:].data_ptr() for i in (0, 3, 6)]
    chunked = [s for s in micro_staging(batch, torch.device("cpu"), 2, None) or () if s]
    assert [len(s[0]) for s in chunked if s[0] is not None] == [4, 3]
    monkeypatch.setattr(transfer, "host_staging", lambda value, device: None)
    assert micro_staging(batch, torch.device("cpu"), None, 3) is None


def test_input_transfer_tasks_use_their_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each input transfer fills its own micro-batch's slice of the step's buffer."""
    calls: list[tuple[int, int | None]] = []
    real = transfer.to_device

    def spy(x: torch.Tensor, device: torch.device, staging: torch.Tensor | None = None) -> object:
        calls.append((x.shape[0], None if staging is None else staging.data_ptr()))
        return real(x, device, staging)

    monkeypatch.setattr("mpstream.runtime.copy.to_device", spy)
    worker = Worker([nn.Linear(2, 2), nn.Linear(2, 2)], EventScheduler([torch.device("cpu")] * 2))
    x, buffer = torch.randn(5, 2), torch.zeros(5, 2)
    micro = scatter(x, None, 2)
    staging = [(b,) for b in buffer.split(2)]
    batches = [(b,) for b in micro]
    forward.run(worker, batches, Schedule("gpipe", 2, 3, [True, False]), staging=staging)
    assert calls == [(2, buffer.data_ptr()), (2, buffer[2:].data_ptr()), (1, buffer[4:].data_ptr())]


def test_target_transfer_tasks_use_their_leafs_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A target's staging lines up with all its leaves, plain ones too: a
    tensor after a plain value is filled into its own buffer, not the one
    of the tensor before it (an int64 mask into a float buffer)."""
    calls: list[tuple[int, int | None]] = []
    real = transfer.to_device

    def spy(x: torch.Tensor, device: torch.device, staging: torch.Tensor | None = None) -> object:
        calls.append((x.data_ptr(), None if staging is None else staging.data_ptr()))
        return real(x, device, staging)

    monkeypatch.setattr("mpstream.runtime.transfer.to_device", spy)
    worker = Worker([nn.Linear(2, 2), nn.Linear(2, 2)], EventScheduler([torch.device("cpu")] * 2))
    x, y, mask = torch.randn(4, 2), torch.randn(4, 2), torch.ones(4, 2, dtype=torch.int64)
    target = ("plain", y, mask)
    buffers = (None, torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.int64))
    staging = [tuple(None if b is None else b[i : i + 2] for b in buffers) for i in (0, 2)]
    schedule = Schedule("gpipe", 2, 2, [True, False], backward=True, copy_target=True)

    def loss_fn(out: torch.Tensor, t: tuple[str, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (out * t[1] * t[2]).sum()

    batches = [(b,) for b in scatter(x, 2, None)]
    targets = scatter(target, 2, None)
    training.run(worker, batches, targets, schedule, loss_fn, [1.0, 1.0], target_staging=staging)
    assert calls == [
        (t.data_ptr(), b.data_ptr())
        for i in (0, 2)
        for t, b in ((y[i:], buffers[1][i:]), (mask[i:], buffers[2][i:]))
    ]

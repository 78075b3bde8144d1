"""Graph work that shares the generator's graph scalars takes turns per device.

:class:`~mpstream.runtime.graphed.rng.RngOrder` runs here on fake streams
and events; warm-up's finding of the passes that draw random numbers runs
on the CPU generator. test_stages_cuda.py checks both on a GPU (dropout in
stages sharing one, against the eager pipe and under CUDA's sanitizer)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from mpstream.runtime.graphed import Emulated
from mpstream.runtime.graphed import rng as rng_module
from mpstream.runtime.graphed.backends import PASSES, warm_up
from mpstream.runtime.graphed.call import GraphedCall
from mpstream.runtime.graphed.grads import GradStore
from mpstream.runtime.graphed.rng import RngOrder, ordered
from tests.helpers import mlp


class Event:
    """A fake CUDA event: how many times it was recorded."""

    def __init__(self) -> None:
        self.records = 0

    def record(self, stream: Any = None) -> None:
        self.records += 1
        stream.log.append((stream.name, "record", self.records))


class Stream:
    """A fake stream logging what is issued on it."""

    def __init__(self, name: str, log: list[tuple[str, str, int]]) -> None:
        self.name, self.log = name, log

    def wait_event(self, event: Event) -> None:
        self.log.append((self.name, "wait", event.records))  # waits on that record

    def work(self) -> None:
        self.log.append((self.name, "work", 0))


def test_each_section_waits_on_the_one_before_it_on_the_device() -> None:
    log: list[tuple[str, str, int]] = []
    a, b = Stream("a", log), Stream("b", log)
    current = [a]
    capturing = [False]
    order = RngOrder(lambda: current[0], Event, lambda: capturing[0])
    with order.section():  # the first: nothing to wait on
        a.work()
    current[0] = b
    with order.section():
        b.work()
    with pytest.raises(RuntimeError, match="capture failed"):
        with order.section():  # a failed one still closes the chain
            b.work()
            raise RuntimeError("capture failed")
    current[0] = a
    with order.section():
        a.work()
        capturing[0] = True  # still capturing at the end: a record would join the graph
    capturing[0] = False
    with order.section():
        a.work()
    assert log == [
        ("a", "work", 0), ("a", "record", 1),
        ("b", "wait", 1), ("b", "work", 0), ("b", "record", 2),
        ("b", "wait", 2), ("b", "work", 0), ("b", "record", 3),
        ("a", "wait", 3), ("a", "work", 0),
        ("a", "wait", 3), ("a", "work", 0), ("a", "record", 4),
    ]  # fmt: skip


def test_sections_from_two_threads_do_not_interleave() -> None:
    # Autograd's device thread replays backward passes beside the issuing thread.
    log: list[tuple[str, str, int]] = []
    current = threading.local()
    order = RngOrder(lambda: current.stream, Event, lambda: False)
    inside, go = threading.Event(), threading.Event()

    def autograd() -> None:
        current.stream = Stream("autograd", log)
        with order.section():
            inside.set()
            go.wait(5)
            current.stream.work()

    worker = threading.Thread(target=autograd)
    worker.start()
    inside.wait(5)
    current.stream = Stream("main", log)
    go.set()
    with order.section():  # waits for the other thread's section to close
        current.stream.work()
    worker.join(5)
    assert log == [
        ("autograd", "work", 0), ("autograd", "record", 1),
        ("main", "wait", 1), ("main", "work", 0), ("main", "record", 2),
    ]  # fmt: skip


def test_a_section_held_past_the_timeout_is_a_clear_error_not_a_hang() -> None:
    # The nested case: a thread holds the order across a capture while
    # another, which the first waits for, needs a section.
    order = RngOrder(lambda: Stream("s", []), Event, lambda: False)
    inside, done = threading.Event(), threading.Event()

    def capture() -> None:
        with order.section():
            inside.set()
            done.wait(5)

    holder = threading.Thread(target=capture, name="capturing thread")
    holder.start()
    inside.wait(5)
    try:
        with pytest.raises(RuntimeError, match="waited 0.05 s for thread 'capturing thread'"):
            with order.section(timeout=0.05):
                pass
    finally:
        done.set()
        holder.join(5)
    with order.section(timeout=0.05):  # free again: nothing was left held
        pass


def test_no_order_where_each_capture_has_scalars_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch 2.13 on: no section, so no lock is held across any capture.
    monkeypatch.setattr(rng_module, "SHARED_SCALARS", False)
    monkeypatch.setattr(rng_module, "_orders", {})
    with ordered(torch.device("cuda", 0)):
        pass
    assert rng_module._orders == {}
    monkeypatch.setattr(rng_module, "SHARED_SCALARS", True)
    section = ordered(torch.device("cuda", 0))  # made lazily: no CUDA call yet
    assert list(rng_module._orders) == [0]
    del section


def test_the_order_is_nothing_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def touched(*args: object, **kwargs: object) -> None:
        raise AssertionError("ordered() touched CUDA for a CPU device")

    for name in ("current_device", "current_stream", "Event", "is_current_stream_capturing"):
        monkeypatch.setattr(torch.cuda, name, touched)
    orders = dict(rng_module._orders)
    cpu = torch.device("cpu")
    log: list[str] = []
    with ordered(cpu):
        log.append("body")
    with pytest.raises(ValueError, match="from the body"):  # passed on, not swallowed
        with ordered(torch.device("cpu", 0)):
            raise ValueError("from the body")
    # No section: another thread's never waits for this one's.
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with ordered(cpu):
            log.append("thread in")
            inside.set()
            leave.wait(5)
        log.append("thread out")

    worker = threading.Thread(target=hold)
    worker.start()
    assert inside.wait(5)
    with ordered(cpu):
        log.append("main")
    leave.set()
    worker.join(5)
    assert log == ["body", "thread in", "main", "thread out"]
    assert rng_module._orders == orders  # no order was made for the CPU


class NoisyGrad(torch.autograd.Function):
    """Draws random numbers in its backward only."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:  # type: ignore[override]
        return g + 0 * torch.rand_like(g)


class Noisy(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return NoisyGrad.apply(x)  # type: ignore[no-any-return]


def position() -> object:
    """Where the CPU generator stands (the CUDA one's offset, on a GPU)."""
    return torch.get_rng_state().tolist()


@pytest.mark.parametrize(
    ("layer", "drawn"),
    [
        (nn.Identity(), frozenset()),
        (nn.Dropout(0.5), frozenset({"forward"})),
        (Noisy(), frozenset({"backward", "weight"})),
    ],
)
def test_warm_up_finds_the_passes_that_draw_random_numbers(
    layer: nn.Module, drawn: frozenset[str]
) -> None:
    stage = nn.Sequential(mlp([5, 8]), layer, mlp([8, 3]))
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    store = GradStore([p for p in stage.parameters()])
    call = GraphedCall(stage, (x,), stage, x.device, True, Emulated(), store)
    before = [g.clone() for g in store.views]
    assert warm_up(call, stage, 2, position)[0] == drawn
    assert warm_up(call, stage, 0, position)[0] == PASSES  # nothing seen: every pass counts
    for g, was in zip(store.views, before):  # warm-up adds no gradient anywhere
        assert torch.equal(g, was)

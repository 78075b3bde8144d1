"""The C++ event scheduler: pooling, runs, aborts, errors and timing (CPU)."""

from __future__ import annotations

import sys
import threading
import time
import weakref
from typing import Any

import pytest
import torch

from mpstream.runtime.scheduler import EventScheduler
from mpstream.schedules.schedule import Kind, Schedule, Topology
from tests.helpers import run_all, virtual_scheduler


def test_no_events_are_created_in_steady_state() -> None:
    sched = virtual_scheduler(3)
    schedule = Schedule("gpipe", 3, 8, [False, True, True], backward=True)
    run_all(sched, schedule)
    created = sched.events_created
    for _ in range(5):
        run_all(sched, schedule)
    assert sched.events_created == created
    assert sched.events_free == created


def test_pool_is_per_device() -> None:
    sched = EventScheduler([torch.device("cuda", 0), torch.device("cuda", 1)], virtual=True)
    sched.recording = True
    run_all(sched, Schedule("gpipe", 2, 4, [False, True]))
    device_of_event: dict[int, torch.device] = {}
    for op in sched.plan():
        if op.op == "record":
            device = sched.slot_devices[op.slot]
            assert device_of_event.setdefault(op.event, device) == device


def test_a_bad_device_is_named() -> None:
    with pytest.raises(ValueError, match=r"devices\[1\] is 'gpu', not a device"):
        EventScheduler(["cpu", "gpu"])  # type: ignore[list-item]


@pytest.mark.parametrize("autograd_orders", [True, False])
def test_grad_copy_orders_the_receiving_compute_stream(autograd_orders: bool) -> None:
    sched = virtual_scheduler(2)
    sched.native.autograd_orders_grad_copies = autograd_orders
    sched.recording = True
    sched.end(sched.begin_grad_copy(0, 1, 3))
    ops = sched.plan()
    # The copy runs on the sending slot, which records an event the receiving
    # copy slot waits on. The compute slot is then ordered after the copy:
    # by autograd's engine on current torch (logged, not issued: it waits on
    # the copy node's stream, the sending slot), else by a wait issued here.
    last = ("autograd" if autograd_orders else "wait", "stage0.compute@cuda:0")
    assert [(op.op, sched.slot_names[op.slot]) for op in ops] == [
        ("run", "stage1.copy@cuda:1"),
        ("record", "stage1.copy@cuda:1"),
        ("wait", "stage0.copy@cuda:0"),
        ("record", "stage0.copy@cuda:0"),
        last,
    ]
    assert all(op.kind == "copy_grad" and op.stage == 0 and op.micro == 3 for op in ops)
    assert ops[1].event == ops[2].event
    assert ops[4].event == (ops[1].event if autograd_orders else ops[3].event)


def test_autograd_ordering_follows_the_installed_torch() -> None:
    from mpstream.runtime.scheduler import AUTOGRAD_ORDERS_GRAD_COPIES

    assert AUTOGRAD_ORDERS_GRAD_COPIES == (torch.__version__ >= (2, 8))  # type: ignore[operator]
    assert virtual_scheduler(2).native.autograd_orders_grad_copies == AUTOGRAD_ORDERS_GRAD_COPIES


def test_recording_toggles_and_clears() -> None:
    sched = virtual_scheduler(2)
    run_all(sched, Schedule("gpipe", 2, 2, [False, True]))
    assert sched.plan() == []
    sched.recording = True
    run_all(sched, Schedule("gpipe", 2, 2, [False, True]))
    assert sched.plan()
    sched.clear_plan()
    assert sched.plan() == []


def test_host_timing_on_cpu_stages() -> None:
    sched = EventScheduler([torch.device("cpu")] * 2)
    schedule = Schedule("gpipe", 2, 3, [False, False])
    sched.timing = True
    sched.begin_run(schedule)
    for t in schedule.tasks:
        handle = sched.begin(t.index)
        time.sleep(0.01 if t.stage == 1 else 0.002)
        sched.end(handle)
    sched.join()
    timings = sched.timings()
    assert [(t.stage, t.micro, t.kind) for t in timings] == [
        (t.stage, t.micro, t.kind.label) for t in schedule.tasks
    ]
    for t in timings:
        assert t.end_ms > t.start_ms >= 0
        assert t.stream == f"stage{t.stage}.compute@cpu"
        expected = 10 if t.stage == 1 else 2
        assert t.end_ms - t.start_ms >= expected * 0.9
        assert t.issue_ms >= expected * 0.9  # the host's time between begin and end
    starts = [t.start_ms for t in timings]
    assert starts == sorted(starts)
    sched.clear_timings()
    assert sched.timings() == []
    assert schedule.tasks[0].kind is Kind.FORWARD


class FakeStream:
    """Stands in for torch.cuda.Stream: pooled streams repeat their ids."""

    def __init__(self, index: int, sid: int) -> None:
        self.device = torch.device("cuda", index)
        self.stream_id = sid


def test_streams_shared_by_stages_are_named_in_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mpstream.runtime import scheduler as module

    sched = EventScheduler([torch.device("cuda", 0)] * 3, virtual=True)
    # 3 stages on cuda:0 from a pool of 4 streams: ids wrap around.
    ids = iter([1, 2, 3, 4, 1, 2, 9])
    sched.compute_streams = [FakeStream(0, next(ids)) for _ in range(3)]  # type: ignore[misc]
    sched.copy_streams = [FakeStream(0, next(ids)) for _ in range(3)]  # type: ignore[misc]
    sched.io_streams = [FakeStream(0, next(ids)) for _ in sched.io_streams]  # type: ignore[misc]
    monkeypatch.setattr(module, "_LIVE", set())
    with pytest.warns(module.StreamAliasWarning) as caught:
        sched._check_aliasing()
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "stage0.compute@cuda:0 = stage1.copy@cuda:0" in text
    assert "stage1.compute@cuda:0 = stage2.copy@cuda:0" in text


def test_streams_shared_with_another_pipe_warn_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpstream.runtime import scheduler as module

    def fake(n: int, first: int) -> EventScheduler:
        sched = EventScheduler([torch.device("cuda", 0)] * n, virtual=True)
        sched.compute_streams = [FakeStream(0, first + i) for i in range(n)]  # type: ignore[misc]
        sched.copy_streams = [FakeStream(0, 100 + first + i) for i in range(n)]  # type: ignore[misc]
        sched.io_streams = [FakeStream(0, 200 + first)]  # type: ignore[misc]
        return sched

    other = fake(2, 0)
    monkeypatch.setattr(module, "_LIVE", {other})
    monkeypatch.setattr(module, "_warned_across_pipes", False)
    mine = fake(2, 1)  # its stage 0 compute stream is `other`'s stage 1 one
    with pytest.warns(module.StreamAliasWarning, match="another live Pipe"):
        mine._check_aliasing()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fake(2, 1)._check_aliasing()  # warned once per process
    fake(2, 50)._check_aliasing()  # no clash, no warning


def test_grad_copy_on_one_device_runs_on_the_forward_copys_stream() -> None:
    """Autograd runs a Copy node on the stream current for its outputs in
    forward; on one device that is the sending stage's copy stream (the only
    one made current), and autograd made it wait for the incoming gradient."""
    sched = EventScheduler([torch.device("cuda", 0)] * 2, virtual=True)
    sched.native.autograd_orders_grad_copies = True
    sched.recording = True
    sched.end(sched.begin_grad_copy(0, 1, 1))
    ops = sched.plan()
    assert [(op.op, sched.slot_names[op.slot]) for op in ops] == [
        ("run", "stage0.copy@cuda:0"),
        ("record", "stage0.copy@cuda:0"),
        ("autograd", "stage0.compute@cuda:0"),
    ]
    assert ops[1].event == ops[2].event


@pytest.mark.parametrize("order", ["gpipe", "1f1b"])
def test_a_task_with_several_producers_reads_none_of_their_events_after_freeing_it(
    order: str,
) -> None:
    # Stage 2 reads stages 0 and 1 (a skip connection), all on one device:
    # when it begins, it is the last reader of both producers' events, and
    # deciding that one wait implies the other reads both. Freeing one
    # before asking about the other read an event back in the pool (the
    # scheduler checks: "read after it went back to the pool").
    sched = EventScheduler([torch.device("cuda", 0)] * 3, virtual=True)
    topology = Topology(((-1,), (0,), (0, 1)), (0, 0, 0), 0, False)
    schedule = Schedule(order, 3, 4, topology, backward=True)
    sched.recording = True
    for _ in range(2):
        run_all(sched, schedule)
    assert sched.events_free == sched.events_created


def test_no_timing_while_a_graph_captures() -> None:
    sched = virtual_scheduler(2)
    sched.native.capturing = True
    with pytest.raises(RuntimeError, match="timing cannot start while a CUDA graph captures"):
        sched.timing = True
    sched.native.capturing = False
    sched.timing = True
    with pytest.raises(RuntimeError, match="cannot capture .* while timing is on"):
        sched.native.capturing = True
    assert not sched.native.capturing


@pytest.mark.cuda
def test_a_host_wait_on_device_work_is_refused_while_capturing() -> None:
    # A CPU stage after a GPU one: the host blocks on the GPU's event, which
    # inside a capture would wait for work that has not run.
    sched = EventScheduler([torch.device("cuda", 0), torch.device("cpu")])
    sched.native.capturing = True
    schedule = Schedule("gpipe", 2, 1, [False, True])
    sched.begin_run(schedule)
    with pytest.raises(RuntimeError, match="would wait for device work .* while a CUDA graph"):
        for t in schedule.tasks:
            sched.end(sched.begin(t.index))
    sched.abort()


@pytest.mark.cuda
def test_a_host_wait_on_device_work_lets_other_python_threads_run() -> None:
    # A CPU stage after a GPU one: ending the copy to the CPU blocks the host
    # until the GPU's work is done. Other Python threads (a DataLoader's
    # pin-memory thread) must run meanwhile: the wait releases the GIL.
    from tests.cuda.helpers import cycles_per_ms

    cycles = int(cycles_per_ms() * 300)
    sched = EventScheduler([torch.device("cuda", 0), torch.device("cpu")])
    schedule = Schedule("gpipe", 2, 1, [False, True])
    slept = torch.cuda.Event()
    go = threading.Event()
    gpu_busy: list[bool] = []

    def other() -> None:
        go.wait()
        gpu_busy.append(not slept.query())

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)  # this thread lets go of the GIL only where it blocks
    try:
        sched.begin_run(schedule)
        for t in schedule.tasks:
            handle = sched.begin(t.index)
            if t.kind == Kind.FORWARD and t.stage == 0:
                torch.cuda._sleep(cycles)  # on stage 0's compute stream, current here
                slept.record()
            if t.kind == Kind.COPY:
                go.set()  # the other thread wakes, and runs once this one blocks
            sched.end(handle)
        sched.join()
    finally:
        sys.setswitchinterval(interval)
    thread.join(30)
    assert gpu_busy == [True]  # it ran inside the wait, not after it


def test_pipes_made_in_two_threads_at_once_both_start(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each thread's first call of its own pipe makes a scheduler, which walks
    # the live ones while the other thread's may be added: the walk raised
    # "Set changed size during iteration". The other thread is made to add
    # its scheduler right inside this thread's walk.
    from mpstream.runtime import scheduler as module

    monkeypatch.setattr(module, "_LIVE", weakref.WeakSet())
    monkeypatch.setattr(module, "_warned_across_pipes", False)
    cpu = [torch.device("cpu")] * 2
    live = [EventScheduler(cpu) for _ in range(2)]  # something to walk
    made: list[EventScheduler] = []
    added = threading.Event()

    def other() -> None:
        made.append(EventScheduler(cpu))
        added.set()

    thread = threading.Thread(target=other, daemon=True)
    resumed = 0

    def trace(frame: Any, event: str, arg: Any) -> None:
        nonlocal resumed
        if event == "call" and frame.f_code is weakref.WeakSet.__iter__.__code__:
            resumed += 1
            if resumed == 2:  # the walk has begun: the other thread adds now
                thread.start()
                added.wait(1)  # fixed, it waits for this walk to end instead

    sys.settrace(trace)
    try:
        mine = EventScheduler(cpu)
    finally:
        sys.settrace(None)
    thread.join(30)
    assert not thread.is_alive()
    assert len(made) == 1
    assert set(module._LIVE) == {*live, mine, *made}

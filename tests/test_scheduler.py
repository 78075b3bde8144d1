"""The C++ event scheduler: pooling, runs, aborts, errors and timing (CPU)."""

from __future__ import annotations

import time

import pytest
import torch

from mpstream.schedule import Kind, Schedule
from mpstream.scheduler import EventScheduler


def run_all(sched: EventScheduler, schedule: Schedule) -> None:
    sched.begin_run(schedule)
    for t in schedule.tasks:
        sched.end(sched.begin(t.index))
    sched.join()


def virtual(n: int) -> EventScheduler:
    return EventScheduler([torch.device("cuda", i) for i in range(n)], virtual=True)


def test_no_events_are_created_in_steady_state() -> None:
    sched = virtual(3)
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


def test_abort_mid_run_releases_everything() -> None:
    sched = virtual(2)
    schedule = Schedule("gpipe", 2, 4, [False, True])
    sched.begin_run(schedule)
    sched.end(sched.begin(0))
    sched.begin(1)  # left open: the task "failed"
    sched.abort()
    assert not sched.native.running
    assert sched.events_free == sched.events_created
    run_all(sched, schedule)  # the next run works
    sched.abort()  # aborting outside a run is harmless


def test_misuse_is_reported() -> None:
    sched = virtual(2)
    schedule = Schedule("gpipe", 2, 2, [False, True])
    with pytest.raises(RuntimeError, match="outside a run"):
        sched.begin(0)
    with pytest.raises(RuntimeError, match="outside a run"):
        sched.join()
    sched.begin_run(schedule)
    with pytest.raises(RuntimeError, match="already in progress"):
        sched.begin_run(schedule)
    with pytest.raises(IndexError, match="out of range"):
        sched.begin(99)
    with pytest.raises(RuntimeError, match="before its dependency"):
        sched.begin(1)  # the copy of micro-batch 0 before its forward ended
    with pytest.raises(ValueError, match="not open"):
        sched.end(12345)
    sched.abort()
    with pytest.raises(ValueError, match="3 stages"):
        sched.begin_run(Schedule("gpipe", 3, 2, [False] * 3))
    with pytest.raises(IndexError, match="outside the pipeline"):
        sched.begin_grad_copy(1, 0)


@pytest.mark.parametrize("autograd_orders", [True, False])
def test_grad_copy_orders_the_receiving_compute_stream(autograd_orders: bool) -> None:
    sched = virtual(2)
    sched.native.autograd_orders_grad_copies = autograd_orders
    sched.recording = True
    sched.end(sched.begin_grad_copy(0, 3))
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
    from mpstream.scheduler import AUTOGRAD_ORDERS_GRAD_COPIES

    assert AUTOGRAD_ORDERS_GRAD_COPIES == (torch.__version__ >= (2, 8))  # type: ignore[operator]
    assert virtual(2).native.autograd_orders_grad_copies == AUTOGRAD_ORDERS_GRAD_COPIES


def test_recording_toggles_and_clears() -> None:
    sched = virtual(2)
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
    starts = [t.start_ms for t in timings]
    assert starts == sorted(starts)
    sched.clear_timings()
    assert sched.timings() == []
    assert schedule.tasks[0].kind is Kind.FORWARD

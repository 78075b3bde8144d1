"""The C++ event scheduler when things go wrong (CPU): aborts mid-run release
every event and order the caller after the failed work, misuse and a task
begun twice are refused, a grad copy whose end fails is closed, and an abort
from another thread names the streams left."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from mpstream import _ext
from mpstream.runtime.scheduler import EventScheduler
from mpstream.runtime.stream import device_type_code
from mpstream.schedules.schedule import Kind, Schedule
from tests.helpers import run_all, virtual_scheduler


def test_abort_mid_run_releases_everything() -> None:
    sched = virtual_scheduler(2)
    schedule = Schedule("gpipe", 2, 4, [False, True])
    sched.begin_run(schedule)
    sched.end(sched.begin(0))
    sched.begin(1)  # left open: the task "failed"
    sched.abort()
    assert not sched.native.running
    assert sched.events_free == sched.events_created
    run_all(sched, schedule)  # the next run works
    sched.abort()  # aborting outside a run is harmless


def test_a_task_begun_twice_is_refused_and_the_run_goes_on() -> None:
    # A second begin() would wait on, and release, its dependencies' events
    # again: an event still held by the first would go back to the pool.
    sched = virtual_scheduler(2)
    schedule = Schedule("gpipe", 2, 2, [False, True])
    copy = next(t.index for t in schedule.tasks if t.kind == Kind.COPY)
    sched.begin_run(schedule)
    for t in schedule.tasks[:copy]:
        sched.end(sched.begin(t.index))
    handle = sched.begin(copy)
    with pytest.raises(RuntimeError, match=rf"task {copy} \(copy of stage 0.*began twice"):
        sched.begin(copy)
    sched.end(handle)
    with pytest.raises(RuntimeError, match="began twice"):
        sched.begin(copy)  # ended meanwhile: still once per run
    for t in schedule.tasks[copy + 1 :]:
        sched.end(sched.begin(t.index))
    sched.join()
    assert sched.events_free == sched.events_created
    run_all(sched, schedule)  # the next run begins each task afresh


def test_misuse_is_reported() -> None:
    sched = virtual_scheduler(2)
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
        sched.begin_grad_copy(1, 2, 0)


def test_end_mark_refuses_a_number_begin_mark_did_not_return() -> None:
    native = EventScheduler([torch.device("cpu")] * 2).native
    native.timing = True
    with pytest.raises(ValueError, match="no begin_mark"):
        native.end_mark(100)  # read past the timed tasks: a crash
    mark = native.begin_mark(_ext.load().Kind.backward, 1, 0)
    native.end_mark(mark)
    (first,) = native.timings()
    native.end_mark(mark)  # a second end keeps the first
    assert native.timings() == [first]


def _reachable(ops: list, start: int) -> set[int]:  # type: ignore[type-arg]
    """Ops ordered after ``start``: slot program order and record -> wait edges."""
    edges: dict[int, list[int]] = {}
    last_on_slot: dict[int, int] = {}
    last_record: dict[int, int] = {}
    for i, op in enumerate(ops):
        if op.slot in last_on_slot:
            edges.setdefault(last_on_slot[op.slot], []).append(i)
        last_on_slot[op.slot] = i
        if op.op == "record":
            last_record[op.event] = i
        elif op.op in ("wait", "sync"):
            edges.setdefault(last_record[op.event], []).append(i)
    seen, stack = {start}, [start]
    while stack:
        for j in edges.get(stack.pop(), []):
            if j not in seen:
                seen.add(j)
                stack.append(j)
    return seen


@pytest.mark.parametrize("failing", ["forward", "copy"])
def test_abort_orders_the_callers_after_the_failed_tasks_work(failing: str) -> None:
    """Kernels a task queued before it failed have no completion event; abort
    records one on each of the task's streams, and on every other stream the
    run used (autograd may have queued work there), before the callers wait."""
    sched = virtual_scheduler(2)
    schedule = Schedule("gpipe", 2, 2, [False, True])
    index = {(t.kind.label, t.stage, t.micro): t.index for t in schedule.tasks}
    sched.recording = True
    sched.begin_run(schedule)
    sched.end(sched.begin(index[("forward", 0, 0)]))
    if failing == "copy":
        sched.begin(index[("copy", 0, 0)])
    else:
        sched.end(sched.begin(index[("copy", 0, 0)]))
        sched.begin(index[("forward", 1, 0)])
    sched.abort()
    ops = sched.plan()
    run = max(i for i, op in enumerate(ops) if op.op == "run")  # the failed task
    after = _reachable(ops, run)
    callers = [i for i, name in enumerate(sched.slot_names) if name.startswith("caller@")]
    task_slots = {
        op.slot for op in ops[run:] if op.op == "record" and op.kind == failing and op.task >= 0
    }
    assert {sched.slot_names[s] for s in task_slots} == (
        {"stage0.copy@cuda:0", "stage1.copy@cuda:1"}
        if failing == "copy"
        else {"stage1.compute@cuda:1"}
    )
    for slot in task_slots:
        caller = next(c for c in callers if sched.slot_devices[c] == sched.slot_devices[slot])
        assert any(ops[i].slot == caller and ops[i].op == "wait" for i in after)
    used = {op.slot for op in ops if op.slot not in callers}
    for slot in used:
        end = max(i for i, op in enumerate(ops) if op.slot == slot)
        assert ops[end].op == "record" and end > run, sched.slot_names[slot]
        caller = next(c for c in callers if sched.slot_devices[c] == sched.slot_devices[slot])
        reached = _reachable(ops, end)
        assert any(ops[i].slot == caller and ops[i].op == "wait" for i in reached)
    assert sched.events_free == sched.events_created


def _cpu_streams_scheduler() -> Any:
    """A C++ scheduler whose stage 0 slots have "streams" on the CPU, whose
    backend has no events: recording there fails as a device error would."""
    cpu = device_type_code(torch.device("cpu"))
    spec = _ext.load().SlotSpec
    stage = [spec(cpu, -1, 0, "s0.compute"), spec(cpu, -1, 0, "s0.copy")]
    stage += [spec(cpu, -1, None, "s1.compute"), spec(cpu, -1, None, "s1.copy")]
    caller, io = [spec(cpu, -1, None, "caller")], [spec(cpu, -1, None, "io")]
    return _ext.load().Scheduler(stage, caller, [0, 0], io)


def test_abort_finishes_its_cleanup_then_raises_the_device_error() -> None:
    native = _cpu_streams_scheduler()
    schedule = Schedule("gpipe", 2, 2, [False, False])
    native.begin_run(schedule.native, [None])
    native.begin(0)  # the failed task: abort records its end, which fails here
    with pytest.raises(RuntimeError, match="doesn't support events"):
        native.abort()
    # ... after it released the run: nothing is left half done.
    assert not native.running
    assert native.events_free == native.events_created


def test_a_grad_copy_whose_end_fails_is_closed_all_the_same() -> None:
    # Autograd opens gradient copies outside any run, so abort() leaves them
    # alone: one whose end() fails (a sticky device error, here a backend
    # without events) must not stay open, its handle taken for good and its
    # streams current on autograd's device thread.
    native = _cpu_streams_scheduler()
    handle = native.begin_grad_copy(0, 1, 0)
    with pytest.raises(RuntimeError, match="doesn't support events"):
        native.end(handle)
    with pytest.raises(ValueError, match="not open"):
        native.end(handle)
    native.abort()
    assert native.begin_grad_copy(0, 1, 0) == handle  # free again


def test_abort_from_another_thread_says_whose_streams_stay() -> None:
    sched = virtual_scheduler(2)
    schedule = Schedule("gpipe", 2, 2, [False, True])
    sched.begin_run(schedule)
    handles: list[int] = []
    opener = threading.Thread(target=lambda: handles.append(sched.begin(0)))
    opener.start()
    opener.join()
    with pytest.raises(RuntimeError, match=r"another thread than the one that began task\(s\) 0"):
        sched.abort()
    assert not sched.native.running and sched.device_error is None  # not the device's
    # The opener's handle is not given to the next run's task meanwhile ...
    sched.begin_run(schedule)
    fresh = sched.begin(0)
    assert fresh != handles[0]
    # ... and its late end(), on its thread, restores its streams and says so.
    late: list[BaseException] = []

    def end_late() -> None:
        try:
            sched.end(handles[0])
        except RuntimeError as exc:
            late.append(exc)

    closer = threading.Thread(target=end_late)
    closer.start()
    closer.join()
    assert "whose run another thread aborted" in str(late[0])
    sched.end(fresh)
    for t in schedule.tasks[1:]:
        sched.end(sched.begin(t.index))
    sched.join()
    assert sched.events_free == sched.events_created

"""The one run loop: every run's tasks, in order, through their kind's
handler, each between the scheduler's begin and end; a failed run aborted
and named, the next one unaffected."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpstream.runtime import executor, forward, training
from mpstream.runtime.executor import execute, range_name
from mpstream.runtime.microbatch import scatter
from mpstream.runtime.plan import Plan, verify_plan
from mpstream.runtime.runs import Run
from mpstream.runtime.scheduler import EventScheduler
from mpstream.runtime.worker import Worker
from mpstream.schedules.schedule import Kind, Schedule, Task


def two_stages() -> tuple[Worker, nn.Sequential]:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    sched = EventScheduler([torch.device("cpu")] * 2)
    return Worker([model[0:2], model[2:]], sched), model


class _Handled:
    """A forward run whose every task is ``handler``'s (what the loop reads of a run)."""

    step = False

    def __init__(self, handler: executor.Handler) -> None:
        self.handlers = {Kind.FORWARD: handler, Kind.COPY: handler}


def test_range_names_carry_kind_stage_and_micro() -> None:
    assert range_name(Kind.FORWARD, 1, 3) == "mpstream/forward/stage1/mb3"
    assert range_name(Kind.COPY, 0, 2) == "mpstream/copy/stage0/mb2"


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1"])
def test_forward_runs_and_training_steps_go_through_the_one_loop(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both runs issue every task of their schedule, in its order, and each
    handler runs while its task is open (the scheduler's current task)."""
    worker, _ = two_stages()
    seen: list[tuple[str, int]] = []
    real = executor.execute

    def spying(*args: object, **kwargs: object) -> None:
        schedule, state = args[1], args[2]
        assert isinstance(schedule, Schedule) and isinstance(state, Run)

        def wrap(kind: Kind, h: executor.Handler) -> executor.Handler:
            def run(r: Run, task: Task) -> None:
                seen.append(("forward" if kind is Kind.FORWARD else kind.label, task.index))
                h(r, task)

            return run

        # The run's own table, shadowed for this run alone.
        state.handlers = {k: wrap(k, h) for k, h in state.handlers.items()}  # type: ignore[misc]
        real(args[0], schedule, state, *args[3:], **kwargs)  # type: ignore[arg-type]
        assert [i for _, i in seen] == [t.index for t in schedule.tasks]
        seen.clear()
        calls.append(state.step)

    calls: list[object] = []
    monkeypatch.setattr(forward, "execute", spying)
    monkeypatch.setattr(training, "execute", spying)
    x = torch.randn(6, 4, dtype=torch.float64)
    micro = [(b,) for b in scatter(x, 3, None)]
    forward.run(worker, micro, Schedule("gpipe", 2, 3, [True, True]))
    step = Schedule(name, 2, 3, [True, True], backward=True, copy_target=True)
    targets = list(torch.randn(6, 2, dtype=torch.float64).chunk(3))
    training.run(worker, micro, targets, step, nn.MSELoss(), [1 / 3] * 3)
    assert calls == [False, True]


def test_a_task_the_run_has_no_handler_for_is_refused_before_it_opens() -> None:
    worker, _ = two_stages()
    schedule = Schedule("1f1b", 2, 2, [True, True], backward=True)
    micro = [(torch.randn(2, 4, dtype=torch.float64),) for _ in range(2)]
    with pytest.raises(RuntimeError, match="forward runs have no backward tasks: the sch"):
        forward.run(worker, micro, schedule)
    # Aborted cleanly: the next run works and plans validly.
    worker.sched.recording = True
    out = forward.run(worker, micro, Schedule("gpipe", 2, 2, [True, True]))
    assert len(out) == 2
    sched = worker.sched
    verify_plan(Plan(sched.plan(), sched.slot_names, sched.slot_devices, 2))


def test_a_failing_handler_aborts_the_run_and_names_its_task() -> None:
    worker, model = two_stages()
    schedule = Schedule("gpipe", 2, 2, [True, True])
    micro = [(torch.randn(2, 4, dtype=torch.float64),) for _ in range(2)]

    def fail(run: object, task: Task) -> None:
        raise ValueError("broken")

    with pytest.raises(ValueError, match="broken") as info:
        execute(worker, schedule, _Handled(fail), 2)  # type: ignore[arg-type]
    first = schedule.tasks[0]
    assert any(f"micro-batch {first.micro}" in n for n in getattr(info.value, "__notes__", []))
    out = forward.run(worker, micro, schedule)
    torch.testing.assert_close(out[1], model(micro[1][0]))


class _InterruptedAsItBegins:
    """The C++ scheduler, but a Ctrl-C lands as ``begin_run`` returns."""

    def __init__(self, native: object) -> None:
        self._native = native

    def begin_run(self, *args: object) -> None:
        self._native.begin_run(*args)  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    def __getattr__(self, name: str) -> object:
        return getattr(self._native, name)


def test_an_interrupt_as_the_run_begins_leaves_the_pipe_usable() -> None:
    worker, model = two_stages()
    schedule = Schedule("gpipe", 2, 2, [True, True])
    micro = [(torch.randn(2, 4, dtype=torch.float64),) for _ in range(2)]
    native = worker.sched.native
    worker.sched.native = _InterruptedAsItBegins(native)  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        forward.run(worker, micro, schedule)
    worker.sched.native = native
    assert not native.running
    out = forward.run(worker, micro, schedule)
    torch.testing.assert_close(out[1], model(micro[1][0]))


def test_a_run_refused_as_it_begins_leaves_the_run_in_progress_alone() -> None:
    worker, _ = two_stages()
    schedule = Schedule("gpipe", 2, 2, [True, True])
    micro = [(torch.randn(2, 4, dtype=torch.float64),) for _ in range(2)]
    refused: list[RuntimeError] = []

    def reenter(run: object, task: Task) -> None:
        if not refused:
            with pytest.raises(RuntimeError, match="already in progress") as info:
                forward.run(worker, micro, schedule)
            refused.append(info.value)
        assert worker.sched.native.running  # the outer run was not aborted

    execute(worker, schedule, _Handled(reenter), 2)  # type: ignore[arg-type]
    assert refused and not worker.sched.native.running

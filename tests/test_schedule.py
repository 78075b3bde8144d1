"""Schedule generation: clock-cycle order, dependencies, 1F1B's memory bound."""

from __future__ import annotations

import pytest

from mpstream.schedule import Kind, Schedule


def key(t: object) -> tuple[str, int, int]:
    return (t.kind.label, t.stage, t.micro)  # type: ignore[attr-defined]


SHAPES = [(1, 1), (1, 4), (2, 1), (2, 5), (3, 4), (4, 8), (5, 3)]


@pytest.mark.parametrize(("stages", "micros"), SHAPES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("copies", ["none", "all", "input"])
def test_tasks_are_complete_and_topological(
    name: str, stages: int, micros: int, copies: str
) -> None:
    copy_in = {
        "none": [False] * stages,
        "all": [True] * stages,
        "input": [True] + [False] * (stages - 1),
    }[copies]
    sched = Schedule(name, stages, micros, copy_in, backward=True)
    keys = [key(t) for t in sched.tasks]
    assert len(keys) == len(set(keys)), "a task appears twice"
    expected = {("forward", s, m) for s in range(stages) for m in range(micros)}
    expected |= {("backward", s, m) for s in range(stages) for m in range(micros)}
    expected |= {("copy", s - 1, m) for s in range(stages) if copy_in[s] for m in range(micros)}
    expected |= {
        ("copy_grad", s - 1, m) for s in range(1, stages) if copy_in[s] for m in range(micros)
    }
    assert set(keys) == expected
    for t in sched.tasks:
        assert all(d < t.index for d in t.deps), f"{t} depends on a later task"
    for t in sched.tasks:
        s, m = t.stage, t.micro
        deps = {key(sched.tasks[d]) for d in t.deps}
        if t.kind is Kind.FORWARD and s > 0:
            assert deps == {("copy", s - 1, m) if copy_in[s] else ("forward", s - 1, m)}
        if t.kind is Kind.FORWARD and s == 0:
            assert deps == ({("copy", -1, m)} if copy_in[0] else set())
        if t.kind is Kind.COPY and s >= 0:
            assert deps == {("forward", s, m)}
        if t.kind is Kind.BACKWARD and s + 1 < stages:
            grad = ("copy_grad", s, m) if copy_in[s + 1] else ("backward", s + 1, m)
            assert deps == {("forward", s, m), grad}
        if t.kind is Kind.COPY_GRAD:
            assert deps == {("backward", s + 1, m)}
    assert [key(sched.tasks[o]) for o in sched.outputs] == [
        ("forward", stages - 1, m) for m in range(micros)
    ]


@pytest.mark.parametrize(("stages", "micros"), SHAPES)
def test_gpipe_forward_follows_clock_cycles(stages: int, micros: int) -> None:
    sched = Schedule("gpipe", stages, micros, [False] + [True] * (stages - 1))
    forwards = [(t.stage, t.micro) for t in sched.tasks if t.kind is Kind.FORWARD]
    assert forwards == sorted(forwards, key=lambda sm: (sm[0] + sm[1], sm[0]))
    for t in sched.tasks:
        if t.kind is Kind.COPY:
            producer = sched.tasks[t.index - 1]
            assert (producer.kind, producer.stage, producer.micro) == (
                Kind.FORWARD,
                t.stage,
                t.micro,
            )
    assert all(t.kind in (Kind.FORWARD, Kind.COPY) for t in sched.tasks)


def test_gpipe_backward_runs_after_all_forwards_in_reverse() -> None:
    sched = Schedule("gpipe", 3, 4, [False, True, False], backward=True)
    kinds = [t.kind for t in sched.tasks]
    first_backward = kinds.index(Kind.BACKWARD)
    assert all(k in (Kind.FORWARD, Kind.COPY) for k in kinds[:first_backward])
    last_stage = [t.micro for t in sched.tasks if t.kind is Kind.BACKWARD and t.stage == 2]
    assert last_stage == [3, 2, 1, 0]


def test_input_copies_run_one_micro_batch_ahead() -> None:
    sched = Schedule("gpipe", 2, 4, [True, False])
    order = [key(t) for t in sched.tasks]
    for m in range(1, 4):
        assert order.index(("copy", -1, m)) < order.index(("forward", 0, m - 1)) + 2
        assert order.index(("copy", -1, m)) < order.index(("forward", 0, m))


def live_activations(sched: Schedule) -> dict[int, int]:
    """Peak count of micro-batches whose forward ran and backward did not, per stage."""
    live = dict.fromkeys(range(sched.stages), 0)
    peak = dict.fromkeys(range(sched.stages), 0)
    for t in sched.tasks:
        if t.kind is Kind.FORWARD:
            live[t.stage] += 1
            peak[t.stage] = max(peak[t.stage], live[t.stage])
        elif t.kind is Kind.BACKWARD:
            live[t.stage] -= 1
    return peak


@pytest.mark.parametrize(("stages", "micros"), [(2, 8), (3, 8), (4, 8), (4, 2), (5, 16)])
def test_1f1b_bounds_live_activations(stages: int, micros: int) -> None:
    peak = live_activations(Schedule("1f1b", stages, micros, [False] * stages))
    for s in range(stages):
        assert peak[s] <= min(stages - s, micros)
    gpipe = live_activations(Schedule("gpipe", stages, micros, [False] * stages, backward=True))
    assert all(gpipe[s] == micros for s in range(stages))


def test_1f1b_stage_sequences() -> None:
    sched = Schedule("1f1b", 3, 5, [False, False, False])
    per_stage = {
        s: ["F" if t.kind is Kind.FORWARD else "B" for t in sched.tasks if t.stage == s]
        for s in range(3)
    }
    assert "".join(per_stage[0]) == "FF" + "FB" * 3 + "BB"
    assert "".join(per_stage[1]) == "F" + "FB" * 4 + "B"
    assert "".join(per_stage[2]) == "FB" * 5
    for s in range(3):
        fwd = [t.micro for t in sched.tasks if t.stage == s and t.kind is Kind.FORWARD]
        bwd = [t.micro for t in sched.tasks if t.stage == s and t.kind is Kind.BACKWARD]
        assert fwd == bwd == list(range(5))


def test_invalid_schedules() -> None:
    with pytest.raises(ValueError, match="valid schedules: 'gpipe', '1f1b'"):
        Schedule("interleaved", 2, 2, [False, False])
    with pytest.raises(ValueError, match="at least one stage"):
        Schedule("gpipe", 0, 2, [])
    with pytest.raises(ValueError, match="at least one micro-batch"):
        Schedule("gpipe", 2, 0, [False, False])
    with pytest.raises(ValueError, match="one entry per stage"):
        Schedule("gpipe", 2, 2, [False])

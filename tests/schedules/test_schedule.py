"""Schedule generation: clock-cycle order, dependencies, every order complete
and runnable stage by stage over many shapes, the memory bounds of 1F1B, ZB-H1
and interleaved 1F1B, ranks of virtual stages."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest

from mpstream.observe.compare import live_activations as live_and_held
from mpstream.schedules import placement_of
from mpstream.schedules.orders import Action, check, parse
from mpstream.schedules.schedule import (
    SCHEDULES,
    Kind,
    Schedule,
    Topology,
    schedule_arg,
    virtual_stages_of,
)
from tests.helpers import fits, virtual_for


def key(t: object) -> tuple[str, int, int]:
    return (t.kind.label, t.stage, t.micro)  # type: ignore[attr-defined]


SHAPES = [(1, 1), (1, 4), (2, 1), (2, 5), (3, 4), (4, 8), (5, 3), (6, 5)]
# Schedules that split every backward into B and W; DualPipe-V splits some.
SPLIT = ("zb_h1", "interleaved_zb", "zbv")


@pytest.mark.parametrize(
    ("stages", "micros", "name"),
    [(s, m, n) for s, m in SHAPES for n in SCHEDULES if fits(n, s)],
)
@pytest.mark.parametrize("copies", ["none", "all", "input"])
def test_tasks_are_complete_and_topological(
    name: str, stages: int, micros: int, copies: str
) -> None:
    copy_in = {
        "none": [False] * stages,
        "all": [True] * stages,
        "input": [True] + [False] * (stages - 1),
    }[copies]
    virtual = virtual_for(name, stages)
    sched = Schedule(name, stages, micros, copy_in, backward=True, virtual_stages=virtual)
    keys = [key(t) for t in sched.tasks]
    assert len(keys) == len(set(keys)), "a task appears twice"
    expected = {("forward", s, m) for s in range(stages) for m in range(micros)}
    expected |= {("backward", s, m) for s in range(stages) for m in range(micros)}
    if name in SPLIT:
        assert sched.split == {(s, m) for s in range(stages) for m in range(micros)}
    if name == "dualpipev":  # rank r splits 2p - r - 1 backwards (cool-down, warm-up)
        p = stages // 2
        assert len(sched.split) <= sum(2 * p - r - 1 for r in range(p))
    expected |= {("weight", s, m) for s, m in sched.split}
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
        if t.kind is Kind.WEIGHT:
            assert deps == {("backward", s, m)}
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
    # The extension dumped its signature at a float, and took True as 1.
    for bad in (2.5, "3", True):
        with pytest.raises(ValueError, match=f"micros must be an int, got {bad!r}"):
            Schedule("gpipe", 2, bad, [False, False])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"stages must be an int, got {bad!r}"):
            Schedule("gpipe", bad, 2, [False, False])  # type: ignore[arg-type]
    # 0 was read as the default: interleaved 1F1B ran one stage per rank.
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="virtual_stages must be an int >= 1 or None"):
            Schedule("interleaved_1f1b", 4, 4, [False] * 4, virtual_stages=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_a_micro_batch_count_past_the_task_indices_is_refused(name: str) -> None:
    # It overflowed int32 arithmetic (gpipe: a wrong error) or allocated
    # without bound (1f1b: minutes, then out of memory).
    with pytest.raises(ValueError, match=r"4 stages and 2147483647 micro-batches .* 2\^24"):
        Schedule(name, 4, 2**31 - 1, [False] * 4, virtual_stages=2)


def test_counts_past_the_extensions_int32_are_refused_by_name() -> None:
    # They reached the extension, which dumped its signature (a TypeError).
    for micros in (2**31, -(2**31) - 1):
        with pytest.raises(ValueError, match=f"micros={micros} is out of range"):
            Schedule("gpipe", 2, micros, [False, False])
    with pytest.raises(ValueError, match=r"stages=2147483648 is out of range.* 2\^24"):
        Schedule("gpipe", 2**31, 2, [False, False])
    with pytest.raises(ValueError, match="virtual_stages=2147483648 is more than the 4 stages"):
        Schedule("interleaved_1f1b", 4, 4, [False] * 4, virtual_stages=2**31)


# The bounds below hold by construction of each schedule's per-stage (or
# per-rank) sequence; the tests check the merged issue order keeps them.


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("micros", [1, 2, 3, 5, 8, 13])
def test_zb_h1_keeps_1f1b_live_activations(stages: int, micros: int) -> None:
    sched = Schedule("zb_h1", stages, micros, [False] * stages)
    live, held = live_and_held(sched)
    for s in range(stages):
        # What B reads: 1F1B's bound. Until W, a stage holds at most what
        # 1F1B's first stage holds (its pipeline-wide peak).
        assert live[s] <= min(stages - s, micros), (s, live)
        assert held[s] <= min(stages, micros), (s, held)
    # Every stage splits every backward, and W follows its B on the stage.
    order = [key(t) for t in sched.tasks]
    for s in range(stages):
        for m in range(micros):
            assert order.index(("backward", s, m)) < order.index(("weight", s, m))


@pytest.mark.parametrize(
    ("ranks", "virtual"), [(3, 1), (1, 2), (2, 2), (2, 3), (3, 2), (4, 2), (4, 3)]
)
@pytest.mark.parametrize("micros", [1, 2, 3, 4, 5, 7, 8, 12])
def test_interleaved_orders_are_complete_and_within_megatrons_bound(
    ranks: int, virtual: int, micros: int
) -> None:
    stages = ranks * virtual
    sched = Schedule("interleaved_1f1b", stages, micros, [False] * stages, virtual_stages=virtual)
    keys = [key(t) for t in sched.tasks]
    assert sorted(keys) == sorted(
        (k, s, m) for k in ("forward", "backward") for s in range(stages) for m in range(micros)
    )
    assert all(d < t.index for t in sched.tasks for d in t.deps)
    # Megatron-LM's warm-up: rank r runs 2(p - r - 1) + (v - 1)p forwards
    # before its first backward, so at most one more is in flight.
    live = [0] * ranks
    peak = [0] * ranks
    for t in sched.tasks:
        r = t.stage % ranks
        live[r] += 1 if t.kind is Kind.FORWARD else -1
        peak[r] = max(peak[r], live[r])
    for r in range(ranks):
        warmup = 2 * (ranks - r - 1) + (virtual - 1) * ranks
        assert peak[r] <= min(warmup + 1, virtual * micros), (r, peak)
    # Each rank forwards its chunks in order within a group of micro-batches.
    first = [t.stage for t in sched.tasks if t.kind is Kind.FORWARD and t.stage % ranks == 0]
    assert first[: min(micros, ranks)] == [0] * min(micros, ranks)


def each_stage_runs_its_list(order: Sequence[Action], reads: Sequence[Sequence[int]]) -> bool:
    """Whether every stage, running its own actions in order and each one
    once what it depends on has run, gets through them (no stage waits on
    another for good)."""
    lists: dict[int, list[Action]] = {}
    for a in order:
        lists.setdefault(a.stage, []).append(a)
    readers = {p: [q for q, r in enumerate(reads) if p in r] for p in range(len(reads))}
    done: set[tuple[str, int, int]] = set()

    def ready(a: Action) -> bool:
        if a.kind == "F":
            return all(p < 0 or ("F", p, a.micro) in done for p in reads[a.stage])
        if a.kind == "W":
            return ("B", a.stage, a.micro) in done
        return ("F", a.stage, a.micro) in done and all(
            ("B", q, a.micro) in done for q in readers[a.stage]
        )

    heads = dict.fromkeys(lists, 0)
    while True:
        ran = [s for s, i in heads.items() if i < len(lists[s]) and ready(lists[s][i])]
        if not ran:
            return all(i == len(lists[s]) for s, i in heads.items())
        for s in ran:
            a = lists[s][heads[s]]
            done.add((a.kind, a.stage, a.micro))
            heads[s] += 1


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_order_is_complete_and_runs_per_stage_over_many_shapes(name: str) -> None:
    # Micro-batch counts below the stage (or rank) count and not a multiple
    # of it included; chains and a graph with skip connections.
    for stages in range(1, 7):
        if not fits(name, stages):
            continue
        virtuals = [v for v in (1, 2, 3) if stages % v == 0]
        if placement_of(name) != "round_robin":
            virtuals = [virtual_for(name, stages) or 1]
        for virtual, micros in itertools.product(virtuals, range(1, 10)):
            for layout in (Topology.chain([True] * stages), skips(stages)):
                sched = Schedule(name, stages, micros, layout, True, virtual_stages=virtual)
                check(list(sched.order), stages, micros, layout.reads)  # raises if not
                assert each_stage_runs_its_list(sched.order, layout.reads)
                if name == "1f1b":
                    for s in range(stages):
                        warm = min(stages - 1 - s, micros)
                        expected = [f"F{m}" for m in range(warm)]
                        for m in range(micros - warm):  # one forward, one backward
                            expected += [f"F{m + warm}", f"B{m}"]
                        expected += [f"B{m}" for m in range(micros - warm, micros)]
                        ours = [f"{a.kind}{a.micro}" for a in sched.order if a.stage == s]
                        assert ours == expected, (stages, micros, s)


def skips(stages: int) -> Topology:
    """A chain where stage s also reads stage s - 2 and the input (skip connections)."""
    reads = tuple(tuple(sorted({-1, s - 2, s - 1} - {-2, -3})) for s in range(stages))
    return Topology(reads, tuple(range(stages)), -1)


def test_each_stage_runs_its_list_catches_a_stage_waiting_for_good() -> None:
    order = parse("F0m0 F1m0 B1m0 B0m0 F0m1 F1m1 B1m1 B0m1")
    chain = [[-1], [0]]
    assert each_stage_runs_its_list(order, chain)
    # Stage 1 backs micro-batch 1 before 0 and stage 0 waits on its B0m0 first: fine.
    assert each_stage_runs_its_list(parse("F0m0 F0m1 F1m0 F1m1 B1m1 B1m0 B0m0 B0m1"), chain)
    # Stage 0 forwards m1 only after B0m0, which needs stage 1's B1m0, which stage 1
    # runs only after F1m1: a cycle across the two lists.
    stuck = parse("F0m0 B0m0 F0m1 B0m1 F1m0 F1m1 B1m0 B1m1")
    assert not each_stage_runs_its_list(stuck, chain)


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedules_work_over_stage_graphs(name: str) -> None:
    # A U-Net-like graph: stage 3 reads stages 2 and 0, stage 2 reads 1 and 0.
    topology = Topology(((-1,), (0,), (0, 1), (0, 2)), (0, 1, 0, 1))
    for micros in (1, 3, 4, 6):
        sched = Schedule(name, 4, micros, topology, virtual_stages=virtual_for(name, 4))
        assert all(d < t.index for t in sched.tasks for d in t.deps)
        fwd = {(t.stage, t.micro): t.index for t in sched.tasks if t.kind is Kind.FORWARD}
        for t in sched.tasks:
            if t.kind is Kind.FORWARD:
                for p in topology.reads[t.stage]:
                    assert p < 0 or fwd[(p, t.micro)] < t.index


def test_virtual_stages_of() -> None:
    assert virtual_stages_of(["cuda:0", "cuda:1", "cuda:0", "cuda:1"]) == 2
    assert virtual_stages_of(["cuda:0", "cuda:1"]) == 1
    assert virtual_stages_of(["cpu"] * 6, 3) == 3
    with pytest.raises(ValueError, match="every stage is on cpu: give virtual_stages="):
        virtual_stages_of(["cpu"] * 4)
    with pytest.raises(ValueError, match=r"round-robin \(cuda:0, cuda:1, cuda:0, cuda:1\)$"):
        virtual_stages_of(["cuda:0", "cuda:0", "cuda:1", "cuda:1"])  # no virtual_stages fits
    with pytest.raises(ValueError, match="or give virtual_stages=2"):
        virtual_stages_of(["a", "a", "b", "b"] * 2)  # two ranks on each device fit
    with pytest.raises(ValueError, match="does not divide the 4 stages"):
        virtual_stages_of(["cpu"] * 4, 3)
    with pytest.raises(ValueError, match="puts stages 0 and 2 on rank 0"):
        virtual_stages_of(["cuda:0", "cuda:0", "cuda:1", "cuda:1"], 2)
    with pytest.raises(ValueError, match="positive int"):
        virtual_stages_of(["cpu"] * 4, 0)
    with pytest.raises(ValueError, match="multiple of virtual_stages"):
        Schedule("interleaved_1f1b", 4, 2, [False] * 4, virtual_stages=3)


def test_auto_outside_a_pipe_says_what_to_give_instead() -> None:
    # simulate("auto") and record_plan("auto") said "unknown schedule 'auto'",
    # which a Pipe takes.
    from mpstream import record_plan, simulate

    match = r"schedule='auto' is what a Pipe chooses .*pipe\.schedule_report\(\)\.chosen"
    with pytest.raises(ValueError, match=match):
        Schedule("auto", 2, 2, [False, False], backward=True)
    with pytest.raises(ValueError, match=match):
        simulate([(1.0, 1.0)] * 2, chunks=2, schedule="auto")
    with pytest.raises(ValueError, match=match):
        record_plan("auto", 2, 2, backward=True)


@pytest.mark.parametrize(
    ("given", "hint"),
    [
        ("1F1B", "(did you mean '1f1b'?)"),
        ("ZB-H1", "(did you mean 'zb_h1'?)"),
        ("Schedule1F1B", "Schedule1F1B is schedule='1f1b' here"),
        ("ScheduleInterleavedZeroBubble", "is schedule='interleaved_zb' here"),
    ],
)
def test_a_name_from_another_library_or_in_capitals_is_named(given: str, hint: str) -> None:
    with pytest.raises(ValueError, match="schedule must be one of") as info:
        schedule_arg(given)
    assert hint in str(info.value)


def test_a_pipelining_schedule_class_is_named() -> None:
    pipelining = pytest.importorskip("torch.distributed.pipelining")
    with pytest.raises(ValueError, match="ScheduleZBVZeroBubble is schedule='zbv' here"):
        schedule_arg(pipelining.ScheduleZBVZeroBubble)
    # What porting code holds: a schedule object (built without its stage here).
    with pytest.raises(ValueError, match="Schedule1F1B is schedule='1f1b' here"):
        schedule_arg(object.__new__(pipelining.Schedule1F1B))


def test_an_unknown_name_gets_no_hint() -> None:
    with pytest.raises(ValueError, match="got 'fill_drain'$"):
        schedule_arg("fill_drain")

"""The schedules of several stages per rank: each rank's order follows its
published rule, activations stay within the published bounds, and a
placement that does not fit is refused naming the stages, their devices and
what to pass."""

from __future__ import annotations

import pytest

from mpstream import Pipe
from mpstream.schedules import (
    PLACEMENTS,
    Kind,
    Schedule,
    peak_activations,
    rank_devices,
    v_stages_of,
    virtual_stages_for,
)
from tests.helpers import mlp


def v_devices(stages: int) -> list[str]:
    return [f"d{min(s, stages - 1 - s)}" for s in range(stages)]


def lane(sched: Schedule, rank: int, ranks: int, v: bool) -> list[str]:
    """The actions of one rank, in issue order, as ``F0m3`` text."""

    def of(s: int) -> int:
        return min(s, sched.stages - 1 - s) if v else s % ranks

    return [str(a) for a in sched.order if of(a.stage) == rank]


def test_placements_come_from_the_core() -> None:
    assert PLACEMENTS == {
        "gpipe": "stage", "1f1b": "stage", "interleaved_1f1b": "round_robin",
        "zb_h1": "stage", "looped_bfs": "round_robin", "interleaved_zb": "round_robin",
        "zbv": "v", "dualpipev": "v",
    }  # fmt: skip


@pytest.mark.parametrize(("ranks", "v", "micros"), [(2, 2, 3), (3, 2, 4), (2, 3, 2)])
def test_looped_bfs_runs_every_micro_batch_through_a_chunk_before_the_next(
    ranks: int, v: int, micros: int
) -> None:
    sched = Schedule("looped_bfs", ranks * v, micros, [False] * (ranks * v), virtual_stages=v)
    for r in range(ranks):
        chunks = [c * ranks + r for c in range(v)]
        expected = [f"F{s}m{m}" for s in chunks for m in range(micros)]
        expected += [f"B{s}m{m}" for s in reversed(chunks) for m in reversed(range(micros))]
        assert lane(sched, r, ranks, False) == expected


@pytest.mark.parametrize(("ranks", "micros"), [(2, 2), (2, 5), (3, 6), (4, 8), (4, 5)])
def test_interleaved_zb_is_interleaved_1f1b_with_deferred_weight_passes(
    ranks: int, micros: int
) -> None:
    stages = 2 * ranks
    zb = Schedule("interleaved_zb", stages, micros, [False] * stages, virtual_stages=2)
    plain = Schedule("interleaved_1f1b", stages, micros, [False] * stages, virtual_stages=2)
    for r in range(ranks):
        ours = lane(zb, r, ranks, False)
        # The forwards and Bs of interleaved 1F1B, in its order ...
        assert [a for a in ours if a[0] != "W"] == lane(plain, r, ranks, False)
        # ... each B followed by its W, rank r deferring at most r of them.
        deferred = 0
        for a in ours:
            deferred += {"B": 1, "W": -1}.get(a[0], 0)
            assert deferred <= r + 1, (r, ours)  # r waiting, and the B just run
        assert deferred == 0


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_zbv_lanes_follow_the_published_phases(ranks: int) -> None:
    p, micros = ranks, 3 * ranks
    sched = Schedule("zbv", 2 * p, micros, [False] * (2 * p))
    for r in range(p):
        ours = lane(sched, r, p, True)
        down, up = r, 2 * p - 1 - r
        # 2(p - r) - 1 chunk-0 forwards fill the time until micro-batch 0 comes back.
        warm = 2 * (p - r) - 1
        assert ours[:warm] == [f"F{down}m{m}" for m in range(warm)]
        assert ours[warm] == f"F{up}m0"  # then micro-batch 0 turns back
        # Forwards and Bs each in micro-batch order per chunk, each W after its B.
        for s in (down, up):
            for k in "FBW":
                assert [a for a in ours if a.startswith(f"{k}{s}m")] == [
                    f"{k}{s}m{m}" for m in range(micros)
                ]
        assert all(ours.index(f"B{s}m{m}") < ours.index(f"W{s}m{m}") for s in (down, up)
                   for m in range(micros))  # fmt: skip


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_dualpipev_lanes_pair_a_forward_with_a_backward(ranks: int) -> None:
    p, micros = ranks, 2 * ranks + 3
    sched = Schedule("dualpipev", 2 * p, micros, [False] * (2 * p))
    for r in range(p):
        ours = lane(sched, r, p, True)
        down, up = r, 2 * p - 1 - r
        assert ours[: 2 * (p - r - 1)] == [f"F{down}m{m}" for m in range(2 * (p - r - 1))]
        # The main phase: m - 2p + r + 1 rounds of F0 B1 F1 B0 (whole backwards).
        main = [
            i for i in range(len(ours) - 3)
            if ours[i].startswith(f"F{down}m") and ours[i + 1].startswith(f"B{up}m")
            and ours[i + 2].startswith(f"F{up}m") and ours[i + 3].startswith(f"B{down}m")
        ]  # fmt: skip
        assert len(main) == micros - 2 * p + r + 1, (r, ours)
        for i in main:
            b1, b0 = ours[i + 1][1:], ours[i + 3][1:]
            assert f"W{b1}" not in ours and f"W{b0}" not in ours
        # Rank r splits 2p - r - 1 backwards (warm-up and cool-down), Ws in the order of the Bs.
        weights = [a for a in ours if a[0] == "W"]
        assert len(weights) == 2 * p - r - 1
        bs = [a[1:] for a in ours if a[0] == "B" and f"W{a[1:]}" in weights]
        assert [w[1:] for w in weights] == bs


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_v_schedules_hold_the_published_activations_per_device(ranks: int) -> None:
    # In chunk activations (a stage is half a rank's layers): ZB-V keeps
    # 1F1B's peak, 2p (p whole ranks' worth); DualPipe-V one chunk more.
    stages = 2 * ranks
    for micros in (2 * ranks, 5 * ranks):
        for name, bound in (("zbv", 2 * ranks), ("dualpipev", 2 * ranks + 1)):
            sched = Schedule(name, stages, micros, [False] * stages)
            peak = peak_activations(sched, [1.0] * stages, v_devices(stages))
            assert list(peak.values()) == [bound] * ranks, (name, micros, peak)
    looped = Schedule("looped_bfs", stages, 8, [False] * stages, virtual_stages=2)
    devices = [f"d{s % ranks}" for s in range(stages)]
    assert set(peak_activations(looped, [1.0] * stages, devices).values()) == {16.0}


def test_a_v_placement_is_checked_against_the_devices() -> None:
    assert v_stages_of(["cuda:0", "cuda:1", "cuda:1", "cuda:0"]) == 2
    assert v_stages_of(["a", "a", "b", "b", "b", "b", "a", "a"]) == 2  # ranks share devices
    assert v_stages_of(["cpu"] * 4, 2) == 2
    with pytest.raises(ValueError, match=r"every stage is on cpu: give virtual_stages=2"):
        v_stages_of(["cpu"] * 4)
    with pytest.raises(ValueError, match="an even number of stages, got 3 .* into 4 or 2 stages"):
        v_stages_of(["cpu"] * 3, 2)
    with pytest.raises(ValueError, match=r"got 1 \(cpu\); split the model into 2 stages$"):
        v_stages_of(["cpu"], 2)  # not 'into 2 or 0 stages'
    with pytest.raises(ValueError, match="virtual_stages must be 2"):
        v_stages_of(["cpu"] * 6, 3, "dualpipev")
    message = (
        r"dualpipev places stages s and 3 - s on one device .* stage 0 is on cuda:0 and stage "
        r"3 on cuda:1 \(got cuda:0, cuda:0, cuda:1, cuda:1\); place them as cuda:0, cuda:1, "
        r"cuda:1, cuda:0$"
    )
    with pytest.raises(ValueError, match=message):
        v_stages_of(["cuda:0", "cuda:0", "cuda:1", "cuda:1"], None, "dualpipev")
    # The advice keeps every device given: two for three ranks share one.
    with pytest.raises(ValueError, match=r"place them as a, a, b, b, a, a$"):
        v_stages_of(["a", "a", "a", "b", "b", "b"])
    with pytest.raises(ValueError, match=r"place them as a, b, c, c, b, a$"):
        v_stages_of(["a", "b", "c", "d", "e", "f"])
    with pytest.raises(ValueError, match="looped_bfs places stages round-robin"):
        virtual_stages_for("looped_bfs", ["cuda:0", "cuda:1", "cuda:1", "cuda:0"], None)
    with pytest.raises(ValueError, match="virtual_stages=2 applies to the schedules that place"):
        virtual_stages_for("1f1b", ["cpu"] * 4, 2)
    # An order as text is named as one, as a Pipe's (a tuple) is, not quoted whole.
    with pytest.raises(ValueError, match=r"not 'an explicit order': drop virtual_stages"):
        virtual_stages_for("F0m0 F1m0 B1m0 B0m0", ["cpu"] * 2, 2)
    assert virtual_stages_for("zbv", ["cuda:0", "cuda:1", "cuda:1", "cuda:0"], None) == 2
    assert virtual_stages_for("interleaved_zb", ["a", "b", "a", "b"], None) == 2


def test_an_order_is_placed_as_its_placement_says_and_a_built_in_as_its_own() -> None:
    order = str(Schedule("zbv", 4, 2, [False] * 4, backward=True))
    assert rank_devices(order, 4, 2) == ["device0", "device0", "device1", "device1"]
    assert rank_devices(order, 4, 2, "v") == rank_devices("zbv", 4, 2)
    assert rank_devices(order, 4, 2, "round_robin") == rank_devices("interleaved_1f1b", 4, 2)
    assert rank_devices("zbv", 4, 2, "v") == ["device0", "device1", "device1", "device0"]
    with pytest.raises(ValueError, match="zbv places its stages as 'v', not 'round_robin'"):
        rank_devices("zbv", 4, 2, "round_robin")
    with pytest.raises(ValueError, match="unknown placement 'ring'"):
        rank_devices(order, 4, 2, "ring")
    with pytest.raises(ValueError, match="^V placement: 4 stages need to be even and at"):
        rank_devices(order, 4, 3, "v")


def test_a_pipe_refuses_a_placement_its_schedule_cannot_run() -> None:
    def pipe(schedule: str, devices: int, **kw: object) -> Pipe:
        widths = [4] * (devices + 1)
        return Pipe(mlp(widths), balance=[2] * devices, devices=["cpu"] * devices,
                    schedule=schedule, **kw)  # type: ignore[arg-type]  # fmt: skip

    with pytest.raises(ValueError, match="every stage is on cpu: give virtual_stages=2 for zbv"):
        pipe("zbv", 4)
    with pytest.raises(ValueError, match="dualpipev places two stages per rank in a V .* got 3"):
        pipe("dualpipev", 3, virtual_stages=2)
    with pytest.raises(ValueError, match="every stage is on cpu: give virtual_stages="):
        pipe("interleaved_zb", 4)
    ok = pipe("zbv", 4, virtual_stages=2)
    assert ok.schedule_for(5, ok.devices[0], training_step=True).virtual_stages == 2
    ok.virtual_stages = None  # changed after construction: the next step says what is wrong
    with pytest.raises(ValueError, match=r"give virtual_stages=2 .*\(set pipe.virtual_stages or"):
        ok.schedule_for(5, ok.devices[0], training_step=True)


def test_any_micro_batch_count_gives_a_complete_order() -> None:
    # Fewer micro-batches than the phases need (2p for the V ones) are
    # padded and the padding dropped; more than that run the phases as published.
    for name in ("zbv", "dualpipev", "looped_bfs", "interleaved_zb"):
        for micros in range(1, 11):
            sched = Schedule(name, 6, micros, [True] * 6, virtual_stages=2)
            kinds = {(t.kind, t.stage, t.micro) for t in sched.tasks}
            for s in range(6):
                for m in range(micros):
                    assert (Kind.FORWARD, s, m) in kinds and (Kind.BACKWARD, s, m) in kinds

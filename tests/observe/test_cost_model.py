"""The cost model reproduces hand-computed pipeline times exactly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from mpstream import Pipe, profile
from mpstream.observe.cost_model import Simulation, simulate
from mpstream.observe.scaling import predict
from mpstream.observe.timeline import Span
from mpstream.runtime.plan import record_plan
from mpstream.schedules import Schedule, Topology

SHAPES = [(1, 1), (1, 5), (2, 1), (2, 4), (3, 8), (4, 8), (5, 3)]


@pytest.mark.parametrize(("stages", "micros"), SHAPES)
def test_fill_drain_forward(stages: int, micros: int) -> None:
    f = 2.5
    assert simulate([f] * stages, 0.0, micros).step_ms == pytest.approx((micros + stages - 1) * f)


@pytest.mark.parametrize(("stages", "micros"), SHAPES)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ratio", [1.0, 2.0])
def test_forward_and_backward(stages: int, micros: int, schedule: str, ratio: float) -> None:
    f, b = 1.5, 1.5 * ratio
    # Uniform stages: both schedules take (M + S - 1)(f + b); 1F1B saves memory, not time.
    expected = (micros + stages - 1) * (f + b)
    assert simulate([(f, b)] * stages, 0.0, micros, schedule).step_ms == pytest.approx(expected)


@pytest.mark.parametrize("micros", [1, 2, 6])
def test_copies_overlap_on_streams_and_stall_the_default_stream(micros: int) -> None:
    f, c = 3.0, 1.0
    # mpstream: the copy of micro-batch m overlaps the compute of m + 1, so
    # it only adds its latency once.
    assert simulate([f, f], c, micros).step_ms == pytest.approx(micros * f + c + f)
    # The tutorial's default streams: every copy blocks both devices.
    assert simulate([f, f], c, micros, overlap=False).step_ms == pytest.approx(micros * (f + c) + f)


def test_stages_sharing_a_device_serialise_without_overlap() -> None:
    f = 2.0
    sim = simulate([f, f], 5.0, 4, overlap=False, devices=["host", "host"])
    assert sim.step_ms == pytest.approx(2 * 4 * f)  # no copy between same-device stages
    # On its own streams, one device: one stage computes at a time by
    # default, or each as if alone.
    assert simulate([f, f], 5.0, 4, devices=["gpu", "gpu"]).step_ms == pytest.approx(8 * f)
    alone = simulate([f, f], 5.0, 4, devices=["gpu", "gpu"], share_compute=False)
    assert alone.step_ms == pytest.approx(5 * f)


@pytest.mark.parametrize(
    ("schedule", "devices"),
    [
        ("zbv", ["a", "b", "b", "a"]),
        ("dualpipev", ["a", "b", "b", "a"]),
        ("interleaved_1f1b", ["a", "b", "a", "b"]),
        ("1f1b", ["a", "a", "b", "b"]),
        ("1f1b", ["a", "b", "c", "d"]),
    ],
)
def test_an_explicit_order_simulates_as_its_built_in_schedule(
    schedule: str, devices: list[str]
) -> None:
    # Stages on one device share its compute by default, whichever way the
    # schedule is given: a copied-out order is no faster than the schedule.
    cost = [(1.0, 1.0, 1.0)] * 4
    built = simulate(cost, 0.2, 4, schedule, devices=devices, virtual_stages=None)
    labels = tuple(sorted(set(devices)).index(d) for d in devices)
    reads = tuple((s - 1,) for s in range(4))
    virtual = 1 if schedule == "1f1b" else 2
    order = str(Schedule(schedule, 4, 4, Topology(reads, labels), virtual_stages=virtual))
    explicit = simulate(cost, 0.2, 4, order, devices=devices)
    assert explicit.step_ms == pytest.approx(built.step_ms)
    assert explicit.timeline.meta["share_compute"] == built.timeline.meta["share_compute"]


@pytest.mark.parametrize("share_compute", [False, 0.5])
def test_a_forced_copy_runs_on_its_senders_copy_stream_alone(share_compute: float) -> None:
    # The runtime runs a copy between stages on one device on the sender's
    # copy stream; the receiver's copy stream waits for it, then records
    # the event its readers wait for.
    plan = record_plan("gpipe", 3, 3, ["cpu"] * 3, force_copies=True)
    runs = [op for op in plan.ops if op.op == "run" and op.kind == "copy"]
    copies = {(op.stage, op.micro): plan.slot_names[op.slot] for op in runs}
    assert copies == {(s, m): f"stage{s}.copy@cpu" for s in (0, 1) for m in range(3)}
    f = c = 1.0
    forced = simulate(
        [f] * 3, c, 3, devices=["gpu"] * 3, force_copies=True, share_compute=share_compute
    )
    # Copy 0->1 of micro-batch 2 runs while copy 1->2 of micro-batch 0 is
    # on stage 1's copy stream; across devices a copy holds both streams.
    assert forced.step_ms == pytest.approx(3 * f + 2 * (f + c))
    assert simulate([f] * 3, c, 3, devices=["a", "b", "c"]).step_ms == pytest.approx(
        4 * f + 2 * (f + c)
    )
    # A short copy 0->1 of micro-batch 2 (3.0 to 3.5) is done once stage 1's
    # copy stream has sent micro-batch 0 on (2.5 to 4.5).
    sim = simulate(
        [f] * 3, [0.5, 2.0], 3, devices=["gpu"] * 3, force_copies=True, share_compute=share_compute
    )
    copy = next(s for s in sim.timeline.spans if (s.kind, s.stage, s.micro) == ("copy", 0, 2))
    assert (copy.start_ms, copy.end_ms) == pytest.approx((3.0, 4.5))
    assert sim.step_ms == pytest.approx(9.5)


def test_copies_are_on_the_rows_a_profile_puts_them() -> None:
    # A copy's span is on its receiving copy stream in a profile (the
    # scheduler times it there), gradient copies included.
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)])
    pipe = Pipe(model, chunks=2, balance=[1] * 3, devices=["cpu"] * 3, force_copies=True)
    with profile(pipe) as prof:
        pipe.train_step(torch.randn(4, 2), torch.randn(4, 2), nn.MSELoss())
    sim = simulate([(1.0, 1.0)] * 3, 1.0, 2, devices=["cpu"] * 3, force_copies=True)

    def rows(spans: list[Span]) -> set[tuple[str, int, int, str]]:
        copies = [s for s in spans if s.kind in ("copy", "copy_grad")]
        return {(s.kind, s.stage, s.peer, s.stream.split("@")[0]) for s in copies}

    assert rows(sim.timeline.spans) == rows(prof.spans)
    assert ("copy_grad", 0, 1, "stage0.copy") in rows(prof.spans)


def test_the_input_copied_to_another_stage_is_on_that_devices_io_stream() -> None:
    # Stage 1 (device b) reads the input, which sits on stage 0's device a.
    reads, f, c = [[-1], [-1], [0, 1]], 1.0, 2.0
    plan = record_plan("gpipe", 3, 1, ["cuda:0", "cuda:1", "cuda:2"], reads=reads)
    (run,) = [op for op in plan.ops if op.op == "run" and op.kind == "copy" and op.stage < 0]
    assert plan.slot_names[run.slot] == "io@cuda:1"
    sim = simulate([f] * 3, c, 3, reads=reads, devices=["a", "b", "c"])
    assert {s.stream for s in sim.timeline.spans if s.stage < 0} == {"io@b"}
    assert sim.timeline.stream_devices["io@b"] == "b"
    # Not on stage 1's copy stream: stage 2's copy stream receives all six
    # copies back to back.
    assert sim.step_ms == pytest.approx(f + 6 * c + f)
    # Default streams: the copy waits for stage 0's forward on device a's
    # stream (the tutorial's order), and leaves device c's alone.
    blocked = simulate([f] * 3, c / 2, 1, overlap=False, reads=reads, devices=["a", "b", "c"])
    assert blocked.step_ms == pytest.approx(3 * f + 2 * (c / 2))


def test_bubble_fraction_of_the_simulated_timeline() -> None:
    stages, micros = 4, 8
    sim = simulate([(1.0, 2.0)] * stages, 0.0, micros)
    summary = sim.timeline.summary(echo=False)
    assert summary.bubble_fraction == pytest.approx((stages - 1) / (micros + stages - 1))
    assert sim.timeline.source == "simulated"


def test_simulated_timeline_plots_and_traces(tmp_path: Path) -> None:
    sim = simulate([(1.0, 2.0), (1.5, 3.0)], (0.5, 0.5), 4, "1f1b")
    assert sim.plot(str(tmp_path / "sim.png")).read_bytes().startswith(b"\x89PNG")
    sim.timeline.export_chrome_trace(tmp_path / "sim.json")
    kinds = {s.kind for s in sim.timeline.spans}
    assert kinds == {"forward", "backward", "copy", "copy_grad"}


def test_invalid_inputs() -> None:
    with pytest.raises(ValueError, match="at least one stage"):
        simulate([], 0.0, 1)
    with pytest.raises(ValueError, match="one per boundary"):
        simulate([1.0, 1.0, 1.0], [0.1], 2)
    with pytest.raises(ValueError, match="negative"):
        simulate([-1.0], 0.0, 1)
    with pytest.raises(ValueError, match="1f1b"):
        simulate([1.0, 1.0], 0.0, 2, "1f1b")
    with pytest.raises(ValueError, match="valid schedules"):
        simulate([1.0], 0.0, 1, "zigzag")
    # A string would read as true; 0 and 1 count, as for Pipe's flags.
    with pytest.raises(TypeError, match="overlap must be a bool, got 'no'"):
        simulate([1.0, 1.0], 1.0, 2, overlap="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="backward must be a bool, got 'no'"):
        simulate([(1.0, 2.0)], 0.0, 1, backward="no")  # type: ignore[arg-type]
    assert simulate([1.0, 1.0], 1.0, 2, overlap=0).overlap is False


def test_a_single_copy_time_applies_to_gradient_copies_too() -> None:
    f, b, c = 1.0, 2.0, 0.5
    sim = simulate([(f, b), (f, b)], c, 1)
    grad_copies = [s for s in sim.timeline.spans if s.kind == "copy_grad"]
    assert [s.duration_ms for s in grad_copies] == [c]
    # One micro-batch through two stages and back: every task on the critical path.
    assert sim.step_ms == pytest.approx(2 * f + c + 2 * b + c)


def test_a_stage_graph_with_a_skip() -> None:
    # Stage 2 reads stages 0 and 1; stage 0's two copies share its copy stream.
    hops = {(0, 1): 1.0, (0, 2): 1.0, (1, 2): 1.0}
    sim = simulate([1.0, 1.0, 1.0], hops, 1, reads=[(-1,), (0,), (0, 1)])
    copies = sorted((s.stage, s.peer, s.start_ms) for s in sim.timeline.spans if s.kind == "copy")
    assert copies == [(0, 1, 1.0), (0, 2, 2.0), (1, 2, 3.0)]
    assert sim.step_ms == pytest.approx(5.0)
    with pytest.raises(ValueError, match="reads needs 3 entries"):
        simulate([1.0, 1.0, 1.0], 0.0, 1, reads=[(-1,), (0,)])


# The papers' bubbles, under their assumptions: every stage (or model chunk)
# costs the same, copies cost nothing, and a device computes one task at a
# time. The bubble is the idle share of the devices' time over the step.


def bubble(sim: Simulation) -> float:
    return sim.timeline.summary(echo=False).device_idle_fraction


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 12])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fill_drain_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(
    p: int, m: int, schedule: str
) -> None:
    # GPipe (Huang et al. 2019) and 1F1B (PipeDream-Flush, Narayanan et al. 2021).
    sim = simulate([(1.0, 2.0)] * p, 0.0, m, schedule)
    assert bubble(sim) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("p", "v"), [(2, 2), (2, 3), (3, 2), (4, 2), (4, 3)])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaved_bubble_shrinks_with_virtual_stages(p: int, v: int, groups: int) -> None:
    # Megatron-LM (Narayanan et al. 2021): p devices, each holding v chunks
    # of 1/v of its layers, m a multiple of p: (p - 1) / (v m + p - 1).
    m = groups * p
    sim = simulate([(1.0 / v, 2.0 / v)] * (p * v), 0.0, m, "interleaved_1f1b", virtual_stages=v)
    assert bubble(sim) == pytest.approx((p - 1) / (v * m + p - 1))
    assert sim.step_ms == pytest.approx(3.0 * m + 3.0 * (p - 1) / v)
    plain = simulate([(1.0, 2.0)] * p, 0.0, m, "1f1b")
    assert sim.step_ms < plain.step_ms


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("m", [6, 8, 12, 24])
def test_zb_h1_bubble_is_a_third_of_1f1b(p: int, m: int) -> None:
    # Zero Bubble (Qi et al. 2024), ZB-H1 with T_F = T_B = T_W and m >= p:
    # each device idles (p - 1)(T_F + T_B - T_W), a third of 1F1B's
    # (p - 1)(T_F + T_B + T_W).
    zb = simulate([(1.0, 1.0, 1.0)] * p, 0.0, m, "zb_h1")
    plain = simulate([(1.0, 1.0, 1.0)] * p, 0.0, m, "1f1b")
    assert zb.step_ms == pytest.approx(3 * m + (p - 1))
    assert plain.step_ms == pytest.approx(3 * (m + p - 1))
    idle = zb.step_ms - 3 * m
    assert idle == pytest.approx((plain.step_ms - 3 * m) / 3)


def test_user_orders_and_shared_devices_are_simulated() -> None:
    order = "F0m0 F1m0 B1m0 W1m0 B0m0 W0m0"
    sim = simulate([(1.0, 1.0, 1.0)] * 2, 0.0, 1, order)
    assert sim.schedule == "custom" and sim.step_ms == pytest.approx(5.0)
    # Interleaved stages share their device's compute by default.
    shared = simulate([(1.0, 2.0)] * 4, 0.0, 4, "interleaved_1f1b", devices=["a", "b", "a", "b"])
    free = simulate(
        [(1.0, 2.0)] * 4, 0.0, 4, "interleaved_1f1b", devices=["a", "b", "a", "b"],
        share_compute=False,
    )  # fmt: skip
    assert shared.step_ms > free.step_ms
    with pytest.raises(ValueError, match="round-robin"):
        simulate([(1.0, 2.0)] * 4, 0.0, 4, "interleaved_1f1b", devices=["a", "a", "b", "b"])
    # Without devices nor virtual_stages each stage would be a rank: plain 1F1B.
    for name in ("interleaved_1f1b", "looped_bfs", "interleaved_zb"):
        with pytest.raises(ValueError, match="give virtual_stages= .* or devices="):
            simulate([(1.0, 2.0, 1.0)] * 4, 0.0, 4, name)
    with pytest.raises(ValueError, match="use mpstream.simulate with devices="):
        predict([1.0] * 4, 2, 4, schedule="interleaved_1f1b")


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "F0m0 F1m0 B1m0 B0m0 F0m1 F1m1 B1m1 B0m1"])
def test_default_streams_keep_a_schedules_order(schedule: str) -> None:
    # Only fill-drain is reordered as the tutorial's loop issues it.
    def order(overlap: bool) -> list[tuple[str, int, int]]:
        sim = simulate([(1.0, 2.0, 1.0)] * 2, chunks=2, schedule=schedule, overlap=overlap)
        spans = sorted(sim.timeline.spans, key=lambda s: (s.start_ms, s.stage))
        return [(s.kind, s.stage, s.micro) for s in spans if s.kind != "copy"]

    assert order(False) == order(True)


def test_all_zero_backward_times_are_named() -> None:
    with pytest.raises(ValueError, match="1f1b schedules backwards, but every backward time is 0"):
        simulate([(1.0, 0.0)] * 2, chunks=2, schedule="1f1b")


def test_a_schedule_with_backwards_and_no_backward_costs_says_what_to_change() -> None:
    order = "F0m0 F1m0 B1m0 B0m0"
    # backward=False with backward costs given: drop it ("give ... a backward
    # cost" named what was there).
    with pytest.raises(ValueError, match=r"^1f1b schedules backwards, but backward=False: drop"):
        simulate([(1.0, 1.0)] * 2, chunks=1, schedule="1f1b", backward=False)
    # predict has no backward=: forward-only layer times are what is missing.
    with pytest.raises(ValueError, match=r"^your order schedules backwards, but every backward"):
        predict([1.0] * 4, 2, 1, schedule=order)
    with pytest.raises(ValueError, match=r"^your order schedules backwards, but every backward"):
        simulate([1.0, 1.0], chunks=1, schedule=order)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"stage_times": [(1.0,)] * 2},
            "stage 0 time must be a number, a .forward, backward. pair",
        ),
        (
            {"stage_times": [(1.0, 1.0, 1.0, 5.0, 1.0)] * 2},
            "or a .forward, input_grad, weight_grad, backward. quadruple",
        ),
        ({"chunks": 2.0}, "chunks must be an int"),
        ({"issue_times": {("fwd", 0): 1.0}}, "issue_times key .'fwd', 0.: expected .kind, stage."),
        ({"copy_times": {(0, 2): 1.0}}, r"copy_times names hops \[\(0, 2\)\]"),
        # As Pipe and record_plan say it: what to do included.
        (
            {"virtual_stages": 2},
            "virtual_stages=2 applies to the schedules that place several stages per rank .*: "
            "drop virtual_stages, or choose one of those",
        ),
    ],
)
def test_simulate_names_a_bad_argument(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"stage_times": [(1.0, 1.0)] * 2, "chunks": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        simulate(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: simulate({0: 1.0, 1: 2.0}, chunks=2), "stage_times must be a sequence"),  # type: ignore[arg-type]
        (lambda: predict({0: 1.0, 1: 2.0}, 2, 2), "layer_times must be a sequence"),  # type: ignore[arg-type]
    ],
)
def test_times_keyed_by_stage_are_refused(call: Callable[[], object], match: str) -> None:
    # Iterated, a dict gives its keys: the stage numbers, read as times.
    with pytest.raises(ValueError, match=match):
        call()


def test_simulate_takes_numpy_numbers() -> None:
    import numpy as np

    step = simulate([(np.float32(1.0), np.float64(1.0))] * 2, chunks=np.int64(2)).step_ms  # type: ignore[arg-type]
    assert step == simulate([(1.0, 1.0)] * 2, chunks=2).step_ms


def test_simulate_takes_array_rows() -> None:
    import numpy as np
    import torch

    expected = simulate([(1.0, 2.0)] * 2, chunks=4).step_ms
    assert simulate(np.array([[1.0, 2.0]] * 2), chunks=4).step_ms == expected  # type: ignore[arg-type]
    assert simulate(torch.tensor([[1.0, 2.0]] * 2), chunks=4).step_ms == expected  # type: ignore[arg-type]

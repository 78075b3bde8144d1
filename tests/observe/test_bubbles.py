"""The simulated bubbles of the schedules of several stages per rank against
the published formulas, with uniform and skewed costs, and what stages that
compute at once on one device's streams predict.

Costs are per stage (a chunk: 1/v of a rank's layers), as ``(F, B_in, W)``;
``B = B_in + W`` is a whole backward, as the papers write it. ``p`` is the
number of devices (ranks); idle time is per device: the step less the time
the device computed anything (stages sharing it compute one at a time, in
issue order, the default for these schedules).
"""

from __future__ import annotations

import pytest

from mpstream import simulate
from mpstream.observe.sharing import Job, play
from mpstream.observe.timeline import COMPUTE

SKEWED = [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0)]


def idle(sim: object) -> list[float]:
    """Per device: the step less the union of its compute spans."""
    timeline = sim.timeline  # type: ignore[attr-defined]
    spans: dict[str, list[tuple[float, float]]] = {}
    for s in timeline.spans:
        if s.kind in COMPUTE:
            spans.setdefault(timeline.stream_devices[s.stream], []).append((s.start_ms, s.end_ms))
    out = []
    for intervals in spans.values():
        busy, end = 0.0, float("-inf")
        for a, b in sorted(intervals):
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        out.append(sim.step_ms - busy)  # type: ignore[attr-defined]
    return out


def v_sim(name: str, cost: tuple[float, float, float], p: int, m: int, **kw: object) -> object:
    return simulate([cost] * (2 * p), 0.0, m, name, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("cost", [*SKEWED, (1.0, 3.0, 2.0)])
@pytest.mark.parametrize(("p", "v"), [(2, 2), (3, 2), (2, 3), (4, 2)])
def test_looped_bfs_idles_p_minus_1_forwards_and_backwards(
    cost: tuple[float, float, float], p: int, v: int
) -> None:
    # Breadth-first (Lamy-Poirier 2022), m >= p: every device idles
    # (p - 1)(F + B), F and B of one stage (1/v of a device's layers), so
    # the bubble is (p - 1) / (v m + p - 1) of the step, as interleaved 1F1B's.
    f, b_in, w = cost
    for m in (p, 2 * p + 1):
        sim = simulate([cost] * (p * v), 0.0, m, "looped_bfs", virtual_stages=v)
        assert idle(sim) == pytest.approx([(p - 1) * (f + b_in + w)] * p)
        per_micro = v * (f + b_in + w)
        assert sim.step_ms == pytest.approx(m * per_micro + (p - 1) * (f + b_in + w))


@pytest.mark.parametrize("cost", SKEWED)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_interleaved_zb_idles_as_zero_bubble_h1_per_stage(
    cost: tuple[float, float, float], p: int
) -> None:
    # ZB-H1's bubble (Qi et al. 2024), (p - 1)(F + B - 2W), with a stage's
    # costs: a third of interleaved 1F1B's (p - 1)(F + B) when F = B_in = W.
    f, b_in, w = cost
    for m in (p, 3 * p):
        sim = simulate([cost] * (2 * p), 0.0, m, "interleaved_zb", virtual_stages=2)
        assert idle(sim) == pytest.approx([(p - 1) * (f + b_in + w - 2 * w)] * p)
    plain = simulate([(1.0, 1.0, 1.0)] * (2 * p), 0.0, 2 * p, "interleaved_1f1b", virtual_stages=2)
    zb = simulate([(1.0, 1.0, 1.0)] * (2 * p), 0.0, 2 * p, "interleaved_zb", virtual_stages=2)
    assert idle(zb)[0] == pytest.approx(idle(plain)[0] / 3)


@pytest.mark.parametrize("cost", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.5, 0.5)])
@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_zbv_bubble_is_near_zero_once_m_is_at_least_2p(
    cost: tuple[float, float, float], p: int
) -> None:
    # ZB-V (Qi et al. 2024): with B_in >= W, each device idles only
    # (p - 1)(F + B - 2W) of one stage's costs, half of ZB-H1's on the same
    # devices (whose stages are two of these); with F = B_in = W only the
    # (p - 1) F the first micro-batch needs to reach the last device.
    f, b_in, w = cost
    for m in (2 * p, 3 * p):
        sim = v_sim("zbv", cost, p, m)
        assert idle(sim) == pytest.approx([(p - 1) * (f + b_in - w)] * p)
        h1 = simulate([(2 * f, 2 * b_in, 2 * w)] * p, 0.0, m, "zb_h1")
        assert 2 * idle(sim)[0] == pytest.approx(idle(h1)[0])
    uniform = v_sim("zbv", (1.0, 1.0, 1.0), p, 4 * p)
    assert uniform.step_ms == pytest.approx(6 * 4 * p + (p - 1))  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "cost", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 1.0, 2.0)]
)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_dualpipev_stays_within_its_published_bubble(
    cost: tuple[float, float, float], p: int
) -> None:
    # DualPipe-V (DeepSeek): (PP/2 - 1)(F&B + B - 3W) over PP = 2p stages,
    # F&B the time of a forward and a backward paired on one device: F + B
    # when the device computes one at a time. The published figure counts
    # each pair as one step that starts when both are ready; mpstream issues
    # them as two tasks on the rank's two streams, each starting when its
    # own inputs are there, so its bubble is at most that, and equal when W
    # dominates (here W = 2 B_in).
    f, b_in, w = cost
    b = b_in + w
    published = (p - 1) * ((f + b) + b - 3 * w)
    for m in (2 * p, 3 * p):
        worst = max(idle(v_sim("dualpipev", cost, p, m)))
        assert worst <= published + 1e-9
        if w == 2 * b_in:
            assert worst == pytest.approx(published)


def test_two_stages_computing_at_once_share_their_device() -> None:
    # A forward (2 ms) and a backward (3 ms) started together on one device,
    # each filling `fill` of it: F&B = max + (2 fill - 1) min.
    for fill, both in ((0.5, 3.0), (0.75, 4.0), (1.0, 5.0)):
        jobs = [Job(("s0",), "d", 2.0, ()), Job(("s1",), "d", 3.0, ())]
        assert max(end for _, end in play(jobs, fill)) == pytest.approx(both)
    # A copy (no device) and a stage on another device are not slowed.
    jobs = [Job(("s0",), "d", 2.0, ()), Job(("c",), None, 2.0, ()), Job(("s1",), "e", 2.0, ())]
    assert [end for _, end in play(jobs, 1.0)] == [2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match=r"share of its device in \(0, 1\]"):
        play(jobs, 0.0)


@pytest.mark.parametrize("name", ["zbv", "dualpipev", "interleaved_1f1b", "1f1b"])
def test_what_concurrent_streams_predict(name: str) -> None:
    # fill=0.5: two stages fit side by side, as if each had the device (the
    # one-pass replay with share_compute=False gives the same step).
    devices = ["a", "b", "b", "a"] if name in ("zbv", "dualpipev") else ["a", "b", "a", "b"]
    kw = {"devices": devices, "virtual_stages": 2} if name != "1f1b" else {"devices": devices}
    cost = [(1.0, 1.0, 1.0)] * 4
    free = simulate(cost, 0.1, 8, name, share_compute=False, **kw)  # type: ignore[arg-type]
    side = simulate(cost, 0.1, 8, name, share_compute=0.5, **kw)  # type: ignore[arg-type]
    assert side.step_ms == pytest.approx(free.step_ms)
    # fill=1.0: a device's throughput is fixed; sharing it slows the pass
    # the others wait for, so running its stages at once is no faster than
    # in turn (True), which the V schedules' pairs cannot beat either.
    turns = simulate(cost, 0.1, 8, name, share_compute=True, **kw)  # type: ignore[arg-type]
    shared = simulate(cost, 0.1, 8, name, share_compute=1.0, **kw)  # type: ignore[arg-type]
    assert shared.step_ms >= turns.step_ms - 1e-9
    assert side.step_ms < turns.step_ms
    with pytest.raises(ValueError, match="share_compute must be True, False or the share"):
        simulate(cost, 0.1, 8, name, share_compute=1.5, **kw)  # type: ignore[arg-type]

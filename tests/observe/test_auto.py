"""``schedule="auto"``: the fastest fitting schedule under a memory budget,
chosen at the first ``train_step`` from given, cached or profiled costs,
reported, and training equal to the unsplit model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import mpstream
from mpstream import Pipe
from mpstream.observe import auto
from mpstream.observe.auto import simulate_candidates
from mpstream.pipe import auto as pipe_auto
from mpstream.schedules import Auto, Candidate, pick
from tests.helpers import assert_same_grads, mlp

UNIFORM = [(1.0, 1.0, 1.0)] * 4


def ranked(devices: list[str], micros: int = 8, **kw: object) -> list[Candidate]:
    fitting, _ = pipe_auto.candidates(devices, None)
    return simulate_candidates(fitting, UNIFORM, devices, micros, **kw)  # type: ignore[arg-type]


def test_the_fastest_fitting_schedule_wins_and_ties_go_to_less_memory() -> None:
    # Two devices in a V: ZB-V, DualPipe-V and ZB-H1 each idle one unit
    # (6 m + 1); ZB-V holds the fewest activations (2p chunks per device).
    v = ranked(["d0", "d1", "d1", "d0"], stage_bytes=[1.0] * 4)
    steps = {c.schedule: c.step_ms for c in v}
    assert set(steps) == {"gpipe", "1f1b", "zb_h1", "zbv", "dualpipev"}
    assert steps["zbv"] == steps["dualpipev"] == 49.0 < steps["1f1b"] < steps["gpipe"]
    assert pick(v).schedule == "zbv"
    assert dict(next(c for c in v if c.schedule == "zbv").peak_bytes) == {"d0": 4.0, "d1": 4.0}
    # Round-robin: interleaved zero-bubble beats interleaved 1F1B's 6 m + 3.
    rr = ranked(["d0", "d1", "d0", "d1"], stage_bytes=[1.0] * 4)
    assert {c.schedule for c in rr} >= {"interleaved_1f1b", "interleaved_zb", "looped_bfs"}
    assert pick(rr).schedule == "interleaved_zb"
    # Slow forwards on the last device: the budget, not the step, decides.
    skewed = simulate_candidates(
        [("gpipe", 1), ("1f1b", 1)], [(1.0, 1.0, 1.0), (3.0, 1.0, 1.0)], ["a", "b"], 6,
        stage_bytes=[10.0, 10.0], memory_budget=25.0,
    )  # fmt: skip
    assert [c.within_budget for c in skewed] == [False, True]
    assert pick(skewed).schedule == "1f1b"


def test_a_budget_nothing_fits_is_an_error_naming_each_peak() -> None:
    v = ranked(["d0", "d1", "d1", "d0"], stage_bytes=[2**20] * 4, memory_budget=3 * 2**20)
    assert not any(c.within_budget for c in v)
    with pytest.raises(ValueError, match=r"no schedule keeps .* zbv: 4\.0 MiB.* checkpoint"):
        pick(v)


def test_a_budget_nothing_fits_advises_checkpointing_only_where_some_is_left() -> None:
    # A pipe already checkpointing every micro-batch was told to checkpoint
    # more (checkpoint='always').
    auto = Auto(costs=UNIFORM, activation_bytes=[2**10] * 4, memory_budget=2**10, cache=None)
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randn(12, 4, dtype=torch.float64)
    for mode, advised in (("always", False), ("except_last", True), ("never", True)):
        pipe = Pipe(mlp([5, 8, 7, 6, 4]), chunks=6, balance=[2] * 4, devices=["cpu"] * 4,
                    schedule=copy.copy(auto), checkpoint=mode)  # fmt: skip
        with pytest.raises(ValueError, match="raise Auto.memory_budget=...") as info:
            pipe.train_step(x, y, nn.MSELoss())
        assert ("checkpoint='always'" in str(info.value)) is advised, mode


def test_auto_trains_equal_to_the_unsplit_model_and_reports_its_choice() -> None:
    model = mlp([5, 8, 7, 6, 4])
    ref = copy.deepcopy(model)
    budget = 8.5 * 2**10  # a KiB per stage and micro-batch: 8 of them on the one device
    auto = Auto(costs=UNIFORM, memory_budget=budget, activation_bytes=[2**10] * 4, cache=None)
    pipe = Pipe(model, split_size=2, balance=[2, 2, 2, 2], devices=["cpu"] * 4, schedule=auto,
                virtual_stages=2, checkpoint="except_last")  # fmt: skip
    x, y = torch.randn(10, 5, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="chooses at the first train_step"):
        pipe.schedule_report()
    torch.testing.assert_close(pipe(x), ref(x))  # a call runs fill-drain, choosing nothing
    with pytest.raises(RuntimeError, match="has not chosen a schedule yet"):
        pipe.schedule_for(5, x.device, training_step=True)
    loss = pipe.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(loss, nn.MSELoss()(ref(x), y))
    nn.MSELoss()(ref(x), y).backward()
    assert_same_grads(pipe, ref)
    report = pipe.schedule_report()
    # One device: every schedule takes as long; the budget leaves those
    # holding at most 8 stages' micro-batches at once (interleaved 1F1B, ZB-V).
    assert report.micros == 5 and report.source == "given (Auto(costs=...))"
    assert {c.step_ms for c in report.candidates} == {report.candidates[0].step_ms}
    assert report.chosen in ("interleaved_1f1b", "zbv")
    chosen = next(c for c in report.candidates if c.schedule == report.chosen)
    assert max(chosen.peak_bytes.values()) <= budget
    gpipe = next(c for c in report.candidates if c.schedule == "gpipe")
    assert not gpipe.within_budget
    text = str(report)
    assert f"chose {report.chosen!r} for 5 micro-batches" in text and "over budget" in text
    assert pipe.schedule_for(5, x.device, training_step=True).name == report.chosen
    pipe.split_size = 5  # two micro-batches: chosen for that count, then kept per count
    pipe.train_step(x, y, nn.MSELoss())
    assert pipe.schedule_report().micros == 2
    pipe.split_size = 2
    pipe.train_step(x, y, nn.MSELoss())
    assert pipe.schedule_report() is report
    pipe.schedule = "auto"  # chooses again at the next step
    with pytest.raises(RuntimeError, match="chooses at the first train_step"):
        pipe.schedule_report()
    pipe.schedule = "1f1b"
    with pytest.raises(ValueError, match="schedule_report\\(\\) describes what schedule='auto'"):
        pipe.schedule_report()


def test_auto_profiles_once_then_reads_the_tuning_cache(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cache = tmp_path / "tune.json"
    model = nn.Sequential(mlp([6, 16, 16]), nn.Dropout(0.5), mlp([16, 16, 3]))
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)

    def run(schedule: object) -> tuple[Pipe, torch.Tensor]:
        pipe = Pipe(copy.deepcopy(model), chunks=4, balance=[1, 2], devices=["cpu"] * 2,
                    schedule=schedule)  # type: ignore[arg-type]  # fmt: skip
        torch.manual_seed(1)
        return pipe, pipe.train_step(x, y, nn.MSELoss())

    plain, expected = run("gpipe")
    pipe, loss = run(Auto(cache=str(cache), memory_budget=2**30))
    # Profiling and measuring left no trace: the same dropout masks, gradients.
    torch.testing.assert_close(loss, expected)
    assert_same_grads(pipe, plain)
    report = pipe.schedule_report()
    assert report.source.startswith("profiled")
    assert all(f > 0 and b > 0 and w >= 0 for f, b, w in report.costs)
    assert all(c.peak_bytes for c in report.candidates)  # measured: one fill-drain step
    (entry,) = json.loads(cache.read_text()).values()
    assert len(entry["stage_costs"]) == 2
    again, _ = run(Auto(cache=str(cache), memory_budget=2**30))
    assert again.schedule_report().source == f"the tuning cache {cache}"
    assert again.schedule_report().costs == report.costs


def test_another_budget_reads_the_costs_profiled_for_the_first(tmp_path: Path) -> None:
    cache = str(tmp_path / "tune.json")
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)

    def source(schedule: Auto) -> str:
        torch.manual_seed(0)
        pipe = Pipe(mlp([6, 16, 3]), chunks=4, balance=[2, 2], devices=["cpu"] * 2,
                    schedule=schedule)  # fmt: skip
        pipe.train_step(x, y, nn.MSELoss())
        return pipe.schedule_report().source

    assert source(Auto(cache=cache)).startswith("profiled")
    assert source(Auto(cache=cache, memory_budget=2**30)) == f"the tuning cache {cache}"


def test_auto_needs_the_cost_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipe_auto, "_installed", [])
    pipe = Pipe(mlp([3, 3]), chunks=2, balance=[2], devices=["cpu"], schedule="auto")
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="chosen by mpstream's cost model, which was not loaded"):
        pipe.train_step(x, x, nn.MSELoss())
    assert mpstream.observe.choose_schedule is not None  # what the facade installs


def test_auto_options_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"costs\[1\] must be a \(forward, input_grad, weight"):
        Auto(costs=[(1.0, 1.0, 1.0), (1.0, 1.0)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="memory_budget must be finite and not negative"):
        Auto(memory_budget=-1.0)
    pipe = Pipe(mlp([3, 3, 3]), chunks=2, balance=[2, 2], devices=["cpu"] * 2,
                schedule=Auto(costs=UNIFORM, cache=None))  # fmt: skip
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"Auto\(costs=...\) needs one entry per stage \(2\)"):
        pipe.train_step(x, x, nn.MSELoss())
    # Checked before the stages' activation bytes are measured (a step each).
    budget = Pipe(mlp([3, 3, 3]), chunks=2, balance=[2, 2], devices=["cpu"] * 2,
                  schedule=Auto(costs=UNIFORM, memory_budget=1e9, cache=None))  # fmt: skip
    measured: list[object] = []
    monkeypatch.setattr(auto, "_stage_bytes", lambda *args: measured.append(args))
    with pytest.raises(ValueError, match=r"Auto\(costs=...\) needs one entry per stage \(2\)"):
        budget.train_step(x, x, nn.MSELoss())
    assert not measured


def test_a_failure_while_auto_chooses_says_so_and_leaves_the_pipe_as_it_was() -> None:
    model = mlp([5, 8, 4])
    pipe = Pipe(model, chunks=2, balance=[2, 2], devices=["cpu"] * 2,
                schedule=Auto(cache=None))  # fmt: skip
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)

    def broken(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise ValueError("a loss that fails")

    with pytest.raises(ValueError, match="a loss that fails") as info:
        pipe.train_step(x, y, broken)
    assert "while schedule='auto' chose a schedule for 2" in "".join(info.value.__notes__)
    assert all(p.grad is None for p in pipe.parameters())
    with pytest.raises(RuntimeError, match="if one failed while choosing, its error says why"):
        pipe.schedule_report()
    pipe.train_step(x, y, nn.MSELoss())
    first = pipe.schedule_report()
    assert first.micros == 2
    # As many micro-batches, each twice as large: what fits memory may differ.
    pipe.train_step(torch.cat([x, x]), torch.cat([y, y]), nn.MSELoss())
    assert pipe.schedule_report() is not first and pipe.schedule_report().micros == 2
    pipe.train_step(x, y, nn.MSELoss())
    assert pipe.schedule_report() is first


def test_a_cached_entry_of_the_wrong_length_is_warned_about_and_measured_again(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "tune.json"
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)

    def source() -> str:
        torch.manual_seed(0)
        pipe = Pipe(mlp([6, 16, 3]), chunks=4, balance=[2, 2], devices=["cpu"] * 2,
                    schedule=Auto(cache=str(cache)))  # fmt: skip
        pipe.train_step(x, y, nn.MSELoss())
        return pipe.schedule_report().source

    assert source().startswith("profiled")
    ((key, entry),) = json.loads(cache.read_text()).items()
    entry["stage_costs"].append([1.0, 1.0, 1.0])  # a damaged file: three stages for two
    cache.write_text(json.dumps({key: entry}))
    # Not blamed on Auto(costs=...), which was not given: the entry is the problem.
    with pytest.warns(UserWarning, match=f"malformed entry of the tuning cache {cache}"):
        assert source().startswith("profiled")
    assert len(json.loads(cache.read_text())[key]["stage_costs"]) == 2  # replaced


def test_a_pipe_pickled_before_its_choices_were_one_object_keeps_what_auto_chose() -> None:
    # pipe/auto.Choices replaced the pipe's _auto_report and _auto_reports: a
    # pipe pickled holding those loaded having chosen nothing, so
    # schedule_report() raised and its next step measured to choose again.
    auto = Auto(costs=UNIFORM, cache=None)
    pipe = Pipe(mlp([5, 8, 7, 6, 4]), split_size=2, balance=[2, 2, 2, 2], devices=["cpu"] * 4,
                schedule=auto)  # fmt: skip
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    pipe.train_step(x, y, nn.MSELoss())
    report = pipe.schedule_report()
    state = pipe.__getstate__()
    choices = state.pop("_auto_choices")
    state["_auto_report"], state["_auto_reports"] = choices.latest, dict(choices.by_sizes)
    old = Pipe.__new__(Pipe)
    old.__setstate__(state)
    assert old.schedule_report() is report
    old.train_step(x, y, nn.MSELoss())  # the same sizes: the choice kept, none made
    assert old.schedule_report() is report
    assert not {"_auto_report", "_auto_reports"} & set(old.__dict__)

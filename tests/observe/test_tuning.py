"""Autotuning: finds the minimum of a synthetic curve, stops early, caches as JSON."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.observe.spread import noisy, spread
from mpstream.observe.tune_args import candidate_split_sizes
from mpstream.observe.tune_result import TunePoint
from mpstream.observe.tuning import TuneResult, default_cache, tune
from tests.observe.curves import SAMPLE, Curve, small_pipe, total

pytestmark = pytest.mark.usefixtures("tune_clock")


def test_finds_the_minimum_and_stops_when_times_rise(tmp_path: Path) -> None:
    model = Curve()
    result = tune(model, SAMPLE, lambda out: out.sum(), cache=tmp_path / "c.json", progress=False)
    assert result.split_size == 6
    assert model.split_size == 6, "the model is left at the best split size"
    assert result.stopped_early
    assert [p.split_size for p in result.curve] == [1, 2, 3, 4, 5, 6, 8, 10]
    assert not result.cached


def test_factory_with_balances_and_plot(tmp_path: Path) -> None:
    built: list[tuple[int, list[int] | None]] = []

    def factory(split_size: int, balance: list[int] | None) -> nn.Module:
        built.append((split_size, balance))
        # Balance [1, 1] is fastest at split 4; [2, 0] is best at 8 but slower.
        model = Curve(best=4, floor_ms=3.0) if balance == [1, 1] else Curve(best=8, floor_ms=9.0)
        model.split_size = split_size
        return model

    result = tune(
        factory,
        SAMPLE,
        None,
        [2, 4, 8],
        balances=[[1, 1], [2, 0], [1, 1]],  # given twice ('time' profiled equal): timed once
        cache=None,
        progress=False,
        plot=tmp_path / "curve.png",
    )
    assert result.split_size == 4 and result.balance == [1, 1]
    assert len(result.curve) == len({(p.split_size, tuple(p.balance or ())) for p in result.curve})
    assert {b for _, b in map(lambda t: (t[0], tuple(t[1] or ())), built)} == {(1, 1), (2, 0)}
    assert (tmp_path / "curve.png").read_bytes().startswith(b"\x89PNG")
    loaded = TuneResult.from_json(result.to_json(), result.key)
    assert loaded.split_size == 4 and loaded.cached


def test_errors() -> None:
    with pytest.raises(TypeError, match="no split_size"):
        tune(nn.Linear(2, 2), SAMPLE, cache=None, progress=False)
    with pytest.raises(ValueError, match="factory"):
        tune(Curve(), SAMPLE, balances=[[1, 1]], cache=None, progress=False)
    with pytest.raises(ValueError, match=r"balances=\[\] lists no balance to try"):
        tune(Curve(), SAMPLE, balances=[], cache=None, progress=False)
    with pytest.raises(ValueError, match="positive ints"):
        tune(Curve(), SAMPLE, split_sizes=[0, 2], cache=None, progress=False)
    with pytest.raises(ValueError, match=r"split size 4 given more than once in .*give each once"):
        tune(Curve(), SAMPLE, split_sizes=[4, 4, 8], cache=None, progress=False)
    with pytest.raises(ValueError, match=r"split sizes 2, 6 given more than once"):
        tune(Curve(), SAMPLE, split_sizes=[6, 2, 6, 2], cache=None, progress=False)
    with pytest.raises(ValueError, match=r"split_sizes=\[\] lists no split size to time"):
        tune(Curve(), SAMPLE, split_sizes=[], cache=None, progress=False)
    with pytest.raises(ValueError, match=r"split_sizes must be a list .* give \[2\]"):
        tune(Curve(), SAMPLE, split_sizes=2, cache=None, progress=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="repeat"):
        tune(Curve(), SAMPLE, repeat=0, cache=None, progress=False)
    with pytest.raises(TypeError, match="not an nn.Module"):
        tune(lambda s: 3, SAMPLE, cache=None, progress=False)


@pytest.mark.parametrize(
    ("knob", "error", "match"),
    [
        ({"tolerance": float("nan")}, ValueError, "tolerance must be a number >= 0"),
        ({"tolerance": -0.1}, ValueError, "tolerance must be a number >= 0"),
        ({"tolerance": "0.1"}, TypeError, "tolerance must be a number, got str"),
        ({"repeat": 1.5}, TypeError, "repeat must be an int, got float"),
        ({"repeat": True}, TypeError, "repeat must be an int, got bool"),
        ({"patience": 1.5}, TypeError, "patience must be an int, got float"),
        ({"patience": 0}, ValueError, "patience must be at least 1, got 0"),
        ({"warmup": 1.5}, TypeError, "warmup must be an int, got float"),
        ({"warmup": -1}, ValueError, "warmup must not be negative, got -1"),
    ],
)
def test_bad_knobs(knob: dict[str, object], error: type[Exception], match: str) -> None:
    model = Curve()
    with pytest.raises(error, match=match):
        tune(model, SAMPLE, cache=None, progress=False, **knob)  # type: ignore[arg-type]
    assert model.split_size == 1  # refused before anything was set


def test_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert candidate_split_sizes(16) == [1, 2, 3, 4, 5, 6, 8, 10, 12, 16]
    assert candidate_split_sizes(7) == [1, 2, 3, 4, 5, 6, 7]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache() == tmp_path / "mpstream" / "tune.json"


def test_tuning_a_pipe_leaves_its_state_and_keys_its_settings(tmp_path: Path) -> None:
    # Gradients being accumulated and BatchNorm statistics are as before;
    # a checkpointed pipe is not answered from an uncheckpointed one's entry.
    def build(checkpoint: str) -> Pipe:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        return Pipe(model, chunks=2, balance=[2, 1], devices=["cpu"] * 2, checkpoint=checkpoint)

    pipe = build("never")
    pipe(SAMPLE).sum().backward()
    grads = [p.grad.clone() for p in pipe.parameters()]  # type: ignore[union-attr]
    buffers = [b.clone() for b in pipe.buffers()]
    path = tmp_path / "c.json"
    tune(pipe, SAMPLE, lambda out: out.sum(), [4, 8], cache=path, progress=False)
    for p, g in zip(pipe.parameters(), grads):
        torch.testing.assert_close(p.grad, g)
    for b, saved in zip(pipe.buffers(), buffers):
        torch.testing.assert_close(b, saved)
    other = tune(build("always"), SAMPLE, lambda out: out.sum(), [4, 8], cache=path, progress=False)
    assert not other.cached


def test_a_target_times_the_pipes_own_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = small_pipe()
    steps: list[int] = []
    step = Pipe._train_step  # the pipe's own step, DDP-wrapped or not
    monkeypatch.setattr(
        Pipe, "_train_step", lambda self, *a, **k: steps.append(1) or step(self, *a, **k)
    )
    y = torch.randn(16, 2)
    result = tune(
        pipe, SAMPLE, nn.functional.mse_loss, [4, 8], target=y, cache=None, progress=False,
        repeat=1, warmup=0,
    )  # fmt: skip
    assert len(steps) == 2 and result.key["mode"] == "train_step"
    with pytest.warns(UserWarning, match="schedule '1f1b' runs only in a Pipe's train_step: pass"):
        tune(pipe, SAMPLE, lambda out: out.sum(), [4], cache=None, progress=False)
    holder = nn.Sequential(pipe)  # a model holding the pipe: a plain backward, with a target too
    holder.split_size = 4  # type: ignore[assignment]
    with pytest.warns(UserWarning, match="'1f1b' runs only in a Pipe's train_step: tune the Pipe"):
        tune(holder, SAMPLE, nn.functional.mse_loss, [4], target=y, cache=None, progress=False)
    with pytest.raises(ValueError, match="give loss_fn"):
        tune(pipe, SAMPLE, target=y, cache=None, progress=False)
    pipe.schedule = "F0m0 F1m0 B1m0 B0m0 F0m1 F1m1 B1m1 B0m1"  # written for 2 micro-batches
    split = pipe.split_size
    with pytest.raises(ValueError, match="explicit order written for one count"):
        tune(pipe, SAMPLE, nn.functional.mse_loss, [4, 8], target=y, cache=None, progress=False)
    assert pipe.split_size == split


def test_no_progress_needs_no_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)  # as if not installed
    assert tune(Curve(), SAMPLE, split_sizes=[2, 6], cache=None, progress=False).split_size == 6


def test_a_failed_sweep_puts_the_split_setting_back() -> None:
    pipe = small_pipe("gpipe")
    calls = [0]

    def loss(out: Tensor) -> Tensor:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("out of memory")
        return out.sum()

    with pytest.raises(RuntimeError, match="out of memory"):
        tune(pipe, SAMPLE, loss, [2, 4, 8], cache=None, progress=False, repeat=1, warmup=0)
    assert pipe.chunks == 2 and pipe.split_size is None


def test_split_sizes_any_int_type_up_to_the_batch() -> None:
    import numpy as np

    result = tune(Curve(), SAMPLE, split_sizes=[np.int64(6), 2], cache=None, progress=False)
    assert [p.split_size for p in result.curve] == [2, 6]
    with pytest.raises(ValueError, match="split size 32 is larger than the batch of 16"):
        tune(Curve(), SAMPLE, split_sizes=[4, 32], cache=None, progress=False)


def test_split_sizes_from_a_generator() -> None:
    sizes = (s for s in (2, 6))
    assert tune(Curve(), SAMPLE, split_sizes=sizes, cache=None, progress=False).split_size == 6  # type: ignore[arg-type]


def test_the_fill_drain_warning_names_the_callers_line_cached_or_not(tmp_path: Path) -> None:
    pipe = small_pipe()  # 1F1B
    run = dict(split_sizes=[4], cache=tmp_path / "c.json", progress=False, repeat=1, warmup=0)
    for _ in range(2):  # measured, then from the cache
        with pytest.warns(UserWarning, match="runs only in a Pipe's train_step") as caught:
            tune(pipe, SAMPLE, total, **run)  # type: ignore[arg-type]
        assert caught[0].filename == __file__


def test_the_plot_draws_every_balance_and_names_what_was_timed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from mpstream.observe import figures

    drawn: list[tuple[list[str], str]] = []
    save = figures.save

    def spy(fig: object, ax: object, path: Path, title: str = "", **kw: object) -> Path:
        drawn.append(([t.get_text() for t in ax.get_legend().texts], ax.get_ylabel()))  # type: ignore[attr-defined]
        return save(fig, ax, path, title, **kw)

    monkeypatch.setattr(figures, "save", spy)
    balances = [[b, 5 - b] for b in range(5)]  # more curves than markers

    def factory(split_size: int, balance: list[int] | None) -> nn.Module:
        model = Curve()
        model.split_size = split_size
        return model

    tune(factory, SAMPLE, total, [2, 4], balances=balances, repeat=1, cache=None,
         progress=False, plot=tmp_path / "curve.png")  # fmt: skip
    ((labels, ylabel),) = drawn
    assert labels == [f"balance {b}" for b in balances]
    assert ylabel.startswith("Curve forward + backward time (s)")
    assert "ResNet50" not in ylabel


def test_a_sweep_that_tried_every_size_did_not_stop_early() -> None:
    # Times rise at 8 and 10, the last two sizes: patience runs out at the
    # last one, with nothing left to skip.
    result = tune(Curve(best=6), SAMPLE, total, [4, 6, 8, 10], cache=None, progress=False)
    assert [p.split_size for p in result.curve] == [4, 6, 8, 10]
    assert not result.stopped_early
    cut = tune(Curve(best=4), SAMPLE, total, [4, 6, 8, 10], cache=None, progress=False)
    assert [p.split_size for p in cut.curve] == [4, 6, 8] and cut.stopped_early


def test_rounds_too_short_to_register_are_not_noisy(tmp_path: Path) -> None:
    # A clock that does not move between calls gives 0 s every round: they
    # agree, so the result is cached and no warning is given.
    path = tmp_path / "c.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tune(Curve(step_ms=0.0, floor_ms=0.0), SAMPLE, total, [2, 4], cache=path, progress=False)
    assert tune(Curve(), SAMPLE, total, [2, 4], cache=path, progress=False).cached
    assert not noisy([0.0, 0.0]) and noisy([0.0, 1e-3]) and spread([0.0]).max_over_min == 1.0


@pytest.mark.parametrize(
    "loss_fn", [nn.MSELoss(), nn.functional.mse_loss, lambda out, target: out.sum()]
)
def test_a_loss_taking_a_target_without_target_says_to_give_one(loss_fn: object) -> None:
    # train_step(x, y, nn.MSELoss()) -> tune(pipe, x, nn.MSELoss()) failed
    # inside the first step with MSELoss's own "missing ... 'target'".
    curve = Curve()
    with pytest.raises(
        ValueError, match=r"loss_fn takes \(output, target\) but tune got no target=: give target="
    ):
        tune(curve, SAMPLE, loss_fn, cache=None, progress=False)  # type: ignore[arg-type]
    assert curve.calls == []  # refused before any step
    # One argument, or a second with a default, is a loss of the output alone.
    tune(Curve(), SAMPLE, lambda out, scale=1.0: out.sum() * scale, [2], cache=None, progress=False)


def test_stops_names_each_balance_that_stopped_and_why() -> None:
    def sweep(balance: list[int], times: list[float]) -> list[TunePoint]:
        return [TunePoint(s, balance, [t]) for s, t in zip([2, 4, 8, 16], times)]

    ran = sweep([1, 1], [0.4, 0.3, 0.2, 0.1])  # every size timed: not early
    cut = sweep([2, 0], [0.2, 0.3])  # 8 and 16 untried
    result = TuneResult(ran[-1], ran + cut, True, False, {"split_sizes": [2, 4, 8, 16]})
    assert result.stops() == (
        "stopped early with balance [2, 0] after split size 4, leaving 8, 16 untried: the size "
        "timed after its fastest, 2, was slower"
    )
    whole = TuneResult(ran[-1], ran, False, False, {"split_sizes": [2, 4, 8, 16]})
    assert whole.stops() == ""

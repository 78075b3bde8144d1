"""Autotuning: finds the minimum of a synthetic curve, stops early, caches as JSON."""

from __future__ import annotations

import json
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.observe import tuning
from mpstream.observe.spread import noisy, spread
from mpstream.observe.tune_cache import model_key
from mpstream.observe.tuning import TuneResult, candidate_split_sizes, default_cache, tune

# tune's clock in these tests: a Curve's forward advances it, so the curve
# it measures does not depend on how busy the machine is.
CLOCK = [0.0]


@pytest.fixture(autouse=True)
def _fake_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(tuning, "time", types.SimpleNamespace(perf_counter=lambda: CLOCK[0]))
    yield


class Curve(nn.Module):
    """A model whose step time is a U-shaped function of its split size."""

    def __init__(self, best: int = 6, step_ms: float = 4.0, floor_ms: float = 3.0) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.split_size = 1
        self.best = best
        self.step_ms = step_ms
        self.floor_ms = floor_ms
        self.calls: list[int] = []

    def forward(self, x: Tensor) -> Tensor:
        self.calls.append(self.split_size)
        CLOCK[0] += (self.floor_ms + self.step_ms * abs(self.split_size - self.best)) / 1e3
        return self.lin(x)


SAMPLE = torch.randn(16, 2)


def _total(out: Tensor) -> Tensor:
    """One loss for the runs that share a cache entry (the key names it)."""
    return out.sum()


def test_finds_the_minimum_and_stops_when_times_rise(tmp_path: Path) -> None:
    model = Curve()
    result = tune(model, SAMPLE, lambda out: out.sum(), cache=tmp_path / "c.json", progress=False)
    assert result.split_size == 6
    assert model.split_size == 6, "the model is left at the best split size"
    assert result.stopped_early
    assert [p.split_size for p in result.curve] == [1, 2, 3, 4, 5, 6, 8, 10]
    assert not result.cached


def test_cache_is_plain_json_and_is_used(tmp_path: Path) -> None:
    path = tmp_path / "cache.json"
    first = tune(Curve(), SAMPLE, None, [2, 6, 12], cache=path, progress=False)
    doc = json.loads(path.read_text())
    ((key_text, entry),) = doc.items()
    key = json.loads(key_text)
    assert key["torch"] == torch.__version__ and key["mode"] == "forward"
    assert key["batch"] == [[[16, 2], "torch.float32", "cpu"]] and key["devices"] == ["cpu"]
    assert key["model"].endswith("Curve") and key["split_sizes"] == [2, 6, 12]
    assert entry["best"]["split_size"] == 6
    model = Curve()
    again = tune(model, SAMPLE, None, [2, 6, 12], cache=path, progress=False)
    assert again.cached and model.calls == [] and again.split_size == first.split_size
    assert model.split_size == 6, "a cache hit leaves the model at the best split size too"
    fresh = tune(model, SAMPLE, None, [2, 6, 12], cache=path, refresh=True, progress=False)
    assert not fresh.cached and model.calls
    # How a result is measured is not in the key (as tune's docstring says):
    # a hit whatever they are, and refresh=True measures with them.
    how = {"repeat": 2, "warmup": 0, "patience": 1, "tolerance": 0.5}
    assert tune(model, SAMPLE, None, [2, 6, 12], cache=path, progress=False, **how).cached
    again = tune(model, SAMPLE, None, [2, 6, 12], cache=path, refresh=True, progress=False, **how)
    assert not again.cached and {len(p.times) for p in again.curve} == {2}


def test_other_batch_shapes_miss_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "cache.json"
    tune(Curve(), SAMPLE, None, [2, 6], cache=path, progress=False)
    model = Curve()
    tune(model, torch.randn(12, 2), None, [2, 6], cache=path, progress=False)
    assert model.calls
    assert len(json.loads(path.read_text())) == 2


def test_unreadable_cache_warns_and_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "cache.json"
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable tuning cache"):
        tune(Curve(), SAMPLE, None, [2, 6], cache=path, progress=False)
    assert json.loads(path.read_text())


def test_a_cache_it_cannot_write_is_warned_about_and_the_result_returned(tmp_path: Path) -> None:
    folder = tmp_path / "cache.json"
    folder.mkdir()  # a folder where the file should be
    with pytest.warns(UserWarning) as caught:  # unreadable, then not writable
        result = tune(Curve(), SAMPLE, None, [2, 6], cache=folder, progress=False)
    assert [str(w.message).split(" ")[0] for w in caught] == ["ignoring", "could"]
    assert result.split_size == 6
    # No temporary file left (the lock file stays, by design).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.json", "cache.json.lock"]


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


def _pipe(schedule: str = "1f1b", **kw: object) -> Pipe:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2))
    return Pipe(model, chunks=2, balance=[2, 1], devices=["cpu"] * 2, schedule=schedule, **kw)


def test_a_target_times_the_pipes_own_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = _pipe()
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


def test_a_malformed_cache_entry_is_measured_again(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    first = tune(Curve(), SAMPLE, _total, [4, 6], cache=path, progress=False)
    doc = json.loads(path.read_text())
    (key,) = doc
    path.write_text(json.dumps({key: {"best": {}}}))  # an older or damaged format
    with pytest.warns(UserWarning, match="malformed entry"):
        again = tune(Curve(), SAMPLE, _total, [4, 6], cache=path, progress=False)
    assert not again.cached and again.split_size == first.split_size


def test_no_progress_needs_no_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)  # as if not installed
    assert tune(Curve(), SAMPLE, split_sizes=[2, 6], cache=None, progress=False).split_size == 6


def test_a_failed_sweep_puts_the_split_setting_back() -> None:
    pipe = _pipe("gpipe")
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


@pytest.mark.parametrize(
    "damage",
    [{"times_s": []}, {"split_size": 0}, {"split_size": 99}],
)
def test_cached_values_that_cannot_be_are_measured_again(
    damage: dict[str, object], tmp_path: Path
) -> None:
    path = tmp_path / "c.json"
    tune(Curve(), SAMPLE, _total, [4, 6], cache=path, progress=False)
    doc = json.loads(path.read_text())
    (key,) = doc
    doc[key]["best"].update(damage)
    doc[key]["curve"][0].update(damage)
    path.write_text(json.dumps(doc))
    model = Curve()
    with pytest.warns(UserWarning, match="malformed entry"):
        again = tune(model, SAMPLE, _total, [4, 6], cache=path, progress=False)
    assert not again.cached and model.split_size == 6


def test_split_sizes_from_a_generator() -> None:
    sizes = (s for s in (2, 6))
    assert tune(Curve(), SAMPLE, split_sizes=sizes, cache=None, progress=False).split_size == 6  # type: ignore[arg-type]


def test_another_loss_or_target_misses_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "cache.json"
    y = torch.randn(16, 2)
    run = dict(split_sizes=[4, 8], cache=path, progress=False, repeat=1, warmup=0)
    tune(_pipe(), SAMPLE, nn.functional.mse_loss, target=y, **run)  # type: ignore[arg-type]
    assert tune(_pipe(), SAMPLE, nn.functional.mse_loss, target=y, **run).cached  # type: ignore[arg-type]
    l1 = tune(_pipe(), SAMPLE, nn.functional.l1_loss, target=y, **run)  # type: ignore[arg-type]
    assert not l1.cached and l1.key["loss"] == "torch.nn.functional.l1_loss"
    mean = nn.L1Loss()
    other = tune(_pipe(), SAMPLE, lambda o, t: mean(o.mean(1), t), target=y[:, 0], **run)  # type: ignore[arg-type]
    assert not other.cached and other.key["target"] == [[[16], "torch.float32", "cpu"]]
    assert len(json.loads(path.read_text())) == 3


def test_results_written_meanwhile_by_another_run_stay(tmp_path: Path) -> None:
    path = tmp_path / "cache.json"
    model = Curve()
    calls = model.calls
    forward = Curve.forward

    def step(self: Curve, x: Tensor) -> Tensor:
        if not calls:  # another run finishes while this one warms up (not timed)
            tune(Curve(), torch.randn(8, 2), None, [2, 4], cache=path, progress=False)
        return forward(self, x)

    model.forward = types.MethodType(step, model)  # type: ignore[method-assign]
    tune(model, SAMPLE, None, [2, 6], cache=path, progress=False)
    assert len(json.loads(path.read_text())) == 2


def test_the_fill_drain_warning_names_the_callers_line_cached_or_not(tmp_path: Path) -> None:
    pipe = _pipe()  # 1F1B
    run = dict(split_sizes=[4], cache=tmp_path / "c.json", progress=False, repeat=1, warmup=0)
    for _ in range(2):  # measured, then from the cache
        with pytest.warns(UserWarning, match="runs only in a Pipe's train_step") as caught:
            tune(pipe, SAMPLE, _total, **run)  # type: ignore[arg-type]
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

    tune(factory, SAMPLE, _total, [2, 4], balances=balances, repeat=1, cache=None,
         progress=False, plot=tmp_path / "curve.png")  # fmt: skip
    ((labels, ylabel),) = drawn
    assert labels == [f"balance {b}" for b in balances]
    assert ylabel.startswith("Curve forward + backward time (s)")
    assert "ResNet50" not in ylabel


class LazyCurve(Curve):
    """A Curve whose first layer has no size until its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.LazyLinear(2)


def test_a_lazy_model_is_tuned_and_keyed_before_its_first_call(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    first = tune(LazyCurve(), SAMPLE, _total, [4, 6], cache=path, progress=False)
    assert first.split_size == 6 and not first.cached
    assert first.key["uninitialized"] == 2 and first.key["parameters"] == 0
    again = tune(LazyCurve(), SAMPLE, _total, [4, 6], cache=path, progress=False)
    assert again.cached, "a fresh lazy model has the same key"
    assert "uninitialized" not in model_key(Curve())


def test_a_sweep_that_tried_every_size_did_not_stop_early() -> None:
    # Times rise at 8 and 10, the last two sizes: patience runs out at the
    # last one, with nothing left to skip.
    result = tune(Curve(best=6), SAMPLE, _total, [4, 6, 8, 10], cache=None, progress=False)
    assert [p.split_size for p in result.curve] == [4, 6, 8, 10]
    assert not result.stopped_early
    cut = tune(Curve(best=4), SAMPLE, _total, [4, 6, 8, 10], cache=None, progress=False)
    assert [p.split_size for p in cut.curve] == [4, 6, 8] and cut.stopped_early


def test_rounds_too_short_to_register_are_not_noisy(tmp_path: Path) -> None:
    # A clock that does not move between calls gives 0 s every round: they
    # agree, so the result is cached and no warning is given.
    path = tmp_path / "c.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tune(Curve(step_ms=0.0, floor_ms=0.0), SAMPLE, _total, [2, 4], cache=path, progress=False)
    assert tune(Curve(), SAMPLE, _total, [2, 4], cache=path, progress=False).cached
    assert not noisy([0.0, 0.0]) and noisy([0.0, 1e-3]) and spread([0.0]).max_over_min == 1.0


def _sum(out: Tensor) -> Tensor:
    return out.sum()


def test_a_pipe_split_at_its_first_call_keeps_its_cache_key(tmp_path: Path) -> None:
    # A torch.export split without sample= is cut at the first call, which
    # tune's own steps make: its repr then shows a balance it did not before.
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    pipe = Pipe(Two(), chunks=2, devices=["cpu"] * 2, split_points=["b"], tracer="export")
    path = tmp_path / "cache.json"
    first, again = (
        tune(pipe, torch.randn(8, 2), _sum, [4, 8], cache=path, progress=False) for _ in range(2)
    )
    assert not first.cached and again.cached


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

"""The tuning cache: what its keys hold (every setting that changes a step, the
model's dtypes and frozen layers, the loss), its file (runs storing into it at
once lose no result), and tune's use of it: hits, misses, damaged entries."""

from __future__ import annotations

import json
import multiprocessing
import time
import types
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.observe import tune_cache
from mpstream.observe.tune_cache import loss_key, model_key
from mpstream.observe.tuning import tune
from mpstream.runtime.graphed import Emulated
from tests.observe.curves import SAMPLE, Curve, LazyCurve, small_pipe, total

pytestmark = pytest.mark.usefixtures("tune_clock")

PROCESSES, ENTRIES = 4, 3


def _store_slowly(path: Path, who: int, start: Any) -> None:
    """Stores ENTRIES results, pausing between reading the file and
    replacing it: without a lock, every other process's stores in that
    pause would be overwritten."""
    read = tune_cache.load

    def slow(path: Path, *, quiet: bool = False) -> dict[str, Any]:
        entries = read(path, quiet=quiet)
        time.sleep(0.03)
        return entries

    tune_cache.load = slow  # this child's copy only
    start.wait()
    for i in range(ENTRIES):
        tune_cache.store(path, f"{who}-{i}", {"who": who})


@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs fork (POSIX)"
)
def test_processes_storing_at_once_lose_no_entry(tmp_path: Path) -> None:
    path = tmp_path / "tune.json"
    # Forked: a child needs no fresh interpreter importing torch.
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    children = [
        ctx.Process(target=_store_slowly, args=(path, who, start)) for who in range(PROCESSES)
    ]
    for child in children:
        child.start()
    start.set()  # all at once
    for child in children:
        child.join(timeout=30)
    assert [c.exitcode for c in children] == [0] * PROCESSES
    expected = {f"{who}-{i}" for who in range(PROCESSES) for i in range(ENTRIES)}
    assert set(json.loads(path.read_text())) == expected


def test_the_key_holds_every_setting_that_changes_a_step() -> None:
    plain = model_key(small_pipe())["settings"]
    assert model_key(small_pipe(compile={"backend": "eager"}))["settings"] != plain
    assert model_key(small_pipe(graphs=True))["settings"] != plain
    # Another graph backend replays differently (the emulated one runs the
    # stage's Python): its own key, the same for each instance of it.
    emulated = model_key(small_pipe(graphs=Emulated()))["settings"]
    assert emulated not in (plain, model_key(small_pipe(graphs=True))["settings"])
    assert model_key(small_pipe(graphs=Emulated()))["settings"] == emulated
    assert model_key(small_pipe().eval())["settings"] != plain


def test_the_key_holds_the_models_dtypes_and_what_trains() -> None:
    # The repr names neither, and a batch of token ids keeps its own key.
    plain = model_key(small_pipe())
    assert model_key(small_pipe().to(torch.float64)) != plain
    frozen = small_pipe()
    next(frozen.parameters()).requires_grad_(False)
    assert model_key(frozen) != plain
    assert model_key(small_pipe()) == plain


def test_the_key_holds_which_layers_are_frozen_not_only_how_many() -> None:
    def pipe() -> Pipe:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        return Pipe(model, chunks=2, balance=[2, 1], devices=["cpu"] * 2)

    first, last = pipe(), pipe()
    first[0].requires_grad_(False)
    last[2].requires_grad_(False)
    assert model_key(first)["trainable"] == model_key(last)["trainable"]
    assert model_key(first) != model_key(last)


class Wrapper(nn.Module):
    """A model around a pipe, its split size the pipe's."""

    def __init__(self, pipe: Pipe) -> None:
        super().__init__()
        self.pipe = pipe

    @property
    def split_size(self) -> int | None:
        return self.pipe.split_size

    @split_size.setter
    def split_size(self, value: int) -> None:
        self.pipe.split_size = value

    def forward(self, x: Tensor) -> Tensor:
        return self.pipe(x)  # type: ignore[no-any-return]


def test_the_key_holds_the_settings_of_a_pipe_inside_the_model() -> None:
    plain = model_key(Wrapper(small_pipe()))
    assert model_key(Wrapper(small_pipe(checkpoint="always"))) != plain
    assert model_key(Wrapper(small_pipe(force_copies=True))) != plain
    assert model_key(Wrapper(small_pipe())) == plain


def test_the_loss_key_tells_lambdas_and_partials_apart() -> None:
    def key(fn: Callable[..., Tensor]) -> str:
        return str(loss_key(fn, None)["loss"])

    first = lambda o, t: o.sum()  # noqa: E731
    second = lambda o, t: o.mean()  # noqa: E731
    assert key(first) != key(second) and key(first) == key(first)
    huber = nn.functional.huber_loss
    assert key(partial(huber, delta=1.0)) != key(partial(huber, delta=2.0))
    assert key(nn.functional.l1_loss) == "torch.nn.functional.l1_loss"
    # A default repr's address changes every run: left out, the key stays.
    assert key(partial(huber, weight=object())) == key(partial(huber, weight=object()))


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


def test_a_malformed_cache_entry_is_measured_again(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    first = tune(Curve(), SAMPLE, total, [4, 6], cache=path, progress=False)
    doc = json.loads(path.read_text())
    (key,) = doc
    path.write_text(json.dumps({key: {"best": {}}}))  # an older or damaged format
    with pytest.warns(UserWarning, match="malformed entry"):
        again = tune(Curve(), SAMPLE, total, [4, 6], cache=path, progress=False)
    assert not again.cached and again.split_size == first.split_size


@pytest.mark.parametrize(
    "damage",
    [{"times_s": []}, {"split_size": 0}, {"split_size": 99}],
)
def test_cached_values_that_cannot_be_are_measured_again(
    damage: dict[str, object], tmp_path: Path
) -> None:
    path = tmp_path / "c.json"
    tune(Curve(), SAMPLE, total, [4, 6], cache=path, progress=False)
    doc = json.loads(path.read_text())
    (key,) = doc
    doc[key]["best"].update(damage)
    doc[key]["curve"][0].update(damage)
    path.write_text(json.dumps(doc))
    model = Curve()
    with pytest.warns(UserWarning, match="malformed entry"):
        again = tune(model, SAMPLE, total, [4, 6], cache=path, progress=False)
    assert not again.cached and model.split_size == 6


def test_another_loss_or_target_misses_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "cache.json"
    y = torch.randn(16, 2)
    run = dict(split_sizes=[4, 8], cache=path, progress=False, repeat=1, warmup=0)
    tune(small_pipe(), SAMPLE, nn.functional.mse_loss, target=y, **run)  # type: ignore[arg-type]
    assert tune(small_pipe(), SAMPLE, nn.functional.mse_loss, target=y, **run).cached  # type: ignore[arg-type]
    l1 = tune(small_pipe(), SAMPLE, nn.functional.l1_loss, target=y, **run)  # type: ignore[arg-type]
    assert not l1.cached and l1.key["loss"] == "torch.nn.functional.l1_loss"
    mean = nn.L1Loss()
    other = tune(small_pipe(), SAMPLE, lambda o, t: mean(o.mean(1), t), target=y[:, 0], **run)  # type: ignore[arg-type]
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


def test_a_lazy_model_is_tuned_and_keyed_before_its_first_call(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    first = tune(LazyCurve(), SAMPLE, total, [4, 6], cache=path, progress=False)
    assert first.split_size == 6 and not first.cached
    assert first.key["uninitialized"] == 2 and first.key["parameters"] == 0
    again = tune(LazyCurve(), SAMPLE, total, [4, 6], cache=path, progress=False)
    assert again.cached, "a fresh lazy model has the same key"
    assert "uninitialized" not in model_key(Curve())


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
        tune(pipe, torch.randn(8, 2), total, [4, 8], cache=path, progress=False) for _ in range(2)
    )
    assert not first.cached and again.cached

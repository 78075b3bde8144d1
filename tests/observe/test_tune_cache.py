"""The tuning cache: what its keys hold (every setting that changes a step, the
model's dtypes and frozen layers, the loss), and its file: runs storing into
it at once lose no result."""

from __future__ import annotations

import json
import multiprocessing
import time
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
from mpstream.runtime.graphed import Emulated

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


def _pipe(**kw: object) -> Pipe:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2))
    return Pipe(model, chunks=2, balance=[2, 1], devices=["cpu"] * 2, schedule="1f1b", **kw)


def test_the_key_holds_every_setting_that_changes_a_step() -> None:
    plain = model_key(_pipe())["settings"]
    assert model_key(_pipe(compile={"backend": "eager"}))["settings"] != plain
    assert model_key(_pipe(graphs=True))["settings"] != plain
    # Another graph backend replays differently (the emulated one runs the
    # stage's Python): its own key, the same for each instance of it.
    emulated = model_key(_pipe(graphs=Emulated()))["settings"]
    assert emulated not in (plain, model_key(_pipe(graphs=True))["settings"])
    assert model_key(_pipe(graphs=Emulated()))["settings"] == emulated
    assert model_key(_pipe().eval())["settings"] != plain


def test_the_key_holds_the_models_dtypes_and_what_trains() -> None:
    # The repr names neither, and a batch of token ids keeps its own key.
    plain = model_key(_pipe())
    assert model_key(_pipe().to(torch.float64)) != plain
    frozen = _pipe()
    next(frozen.parameters()).requires_grad_(False)
    assert model_key(frozen) != plain
    assert model_key(_pipe()) == plain


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
    plain = model_key(Wrapper(_pipe()))
    assert model_key(Wrapper(_pipe(checkpoint="always"))) != plain
    assert model_key(Wrapper(_pipe(force_copies=True))) != plain
    assert model_key(Wrapper(_pipe())) == plain


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

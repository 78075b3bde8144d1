"""mpstream's warnings point at the user's own line, whichever public call
led to them and however deep inside mpstream (or torch's Module call,
autograd, a ``with`` block's exit) they are raised (``mpstream._warn``);
the single-micro-batch warning's entry points are in
tests/pipe/test_single_micro_batch.py."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe, tune


class Pair(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x * 2


class Masked(nn.Module):
    """torch's Pipe style: the values spread, ``mask`` optional (warned)."""

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return x if mask is None else x * mask


class Twice(nn.Module):
    """One BatchNorm called twice in a forward (its deferred twin warns)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(torch.tanh(self.bn(x)))


def two_stages(*layers: nn.Module, **kwargs: object) -> Pipe:
    model = nn.Sequential(nn.Linear(4, 4), *layers).double()
    return Pipe(model, chunks=2, balance=[1, len(layers)], devices=["cpu", "cpu"], **kwargs)  # type: ignore[arg-type]


def x() -> Tensor:
    return torch.randn(8, 4, dtype=torch.float64)


def spread_into_a_layer() -> None:
    pipe = two_stages(Pair(), Masked())
    pipe(x()).sum().backward()


def a_norm_called_twice_in_pipe_x() -> None:
    pipe = two_stages(Twice(), deferred_batch_norm=True)
    pipe(x())


def a_norm_called_twice_in_train_step() -> None:
    pipe = two_stages(Twice(), deferred_batch_norm=True)
    pipe.train_step(x(), x(), nn.MSELoss())


def an_unreadable_tuning_cache(tmp_path: Path) -> None:
    (tmp_path / "cache.json").write_text("{not json")
    pipe = two_stages(nn.Linear(4, 4))
    tune(pipe, x(), None, [4, 8], cache=tmp_path / "cache.json", progress=False, repeat=1)


def a_tuning_cache_it_cannot_write(tmp_path: Path) -> None:
    (tmp_path / "cache.json").mkdir()  # a folder where the file should be
    pipe = two_stages(nn.Linear(4, 4))
    tune(pipe, x(), None, [4, 8], cache=tmp_path / "cache.json", progress=False, repeat=1)


CALLS: dict[str, tuple[Callable[..., None], str]] = {
    "a tuple spread into a layer": (spread_into_a_layer, "gets a tuple of 2 values"),
    "DeferredBatchNorm pooled, pipe(x)": (a_norm_called_twice_in_pipe_x, "ran 4 times"),
    "DeferredBatchNorm pooled, train_step": (a_norm_called_twice_in_train_step, "ran 4 times"),
    "an unreadable tuning cache": (an_unreadable_tuning_cache, "unreadable tuning cache"),
    "a tuning cache it cannot write": (a_tuning_cache_it_cannot_write, "could not write"),
}


@pytest.mark.parametrize("case", CALLS)
def test_a_warning_points_at_the_public_call_that_led_to_it(case: str, tmp_path: Path) -> None:
    run, said = CALLS[case]
    lines, first = inspect.getsourcelines(run)
    call = first + len(lines) - 1  # each case's public call is its last line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(*([tmp_path] if inspect.signature(run).parameters else []))
    ours = [w for w in caught if said in str(w.message)]
    assert ours, [str(w.message) for w in caught]
    assert [(w.filename, w.lineno) for w in ours] == [(__file__, call)] * len(ours)


def test_under_python_m_mpstream_a_warning_points_at_its_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No frame of the user's lies under ``python -m mpstream`` (runpy's
    # are frozen; this file's are made mpstream's here): it pointed at
    # mpstream's own line that warned, where the ``mpstream`` script's
    # points at the script's line.
    import importlib
    import runpy

    import mpstream
    from mpstream import _warn

    cli_main = importlib.import_module("mpstream.cli.main")
    monkeypatch.setattr(cli_main, "main", lambda: _warn.warn("from the command") or 0)
    monkeypatch.setattr(_warn, "_NOT_THE_USERS", (*_warn._NOT_THE_USERS, __file__))
    entry = Path(mpstream.__file__).with_name("__main__.py")
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit):
        warnings.simplefilter("always")
        runpy.run_module("mpstream", run_name="__main__")
    ours = [w for w in caught if str(w.message) == "from the command"]
    call = entry.read_text().splitlines().index("sys.exit(main())") + 1
    assert [(w.filename, w.lineno) for w in ours] == [(str(entry), call)]

"""mpstream's own ``torch.export`` attempts keep torch's reports off stderr
(mpstream.stages.quiet_export): a model neither tracer splits fails with
mpstream's three-line error, not symbolic_shapes' warning and the graph
dumps torch prints; each logger's level comes back after, what else the
module writes to stderr still comes out, and a user who asked for torch's
logs (``TORCH_LOGS``, or a logger set to DEBUG) keeps them. Only the
exporting thread's writes are held: other threads' pass through, and
exports in several threads at once each hold their own."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.stages.quiet_export import quiet_export

SHAPES = "torch.fx.experimental.symbolic_shapes"
DYNAMO = "torch._dynamo"


class _Branch(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x if x.mean() > 0 else -x  # a branch on a value: neither tracer


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.gate, self.out = nn.Linear(4, 4), _Branch(), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.gate(self.inp(x)))


class _Talks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        print("the module's own line", file=sys.stderr)
        return self.b(self.a(x))


@pytest.fixture
def levels() -> Iterator[None]:
    """The two loggers' own levels, put back after the test."""
    saved = {name: logging.getLogger(name).level for name in (SHAPES, DYNAMO)}
    yield
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)


def _levels_during_export(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Each logger's level while mpstream's export runs (a stand-in export
    that records them and fails)."""
    seen: dict[str, int] = {}

    def export(*args: Any, **kwargs: Any) -> Any:
        seen.update({name: logging.getLogger(name).level for name in (SHAPES, DYNAMO)})
        raise RuntimeError("the stand-in export fails")

    monkeypatch.setattr(torch.export, "export", export)
    with pytest.raises(TypeError, match="could not export _Branchy"):
        Pipe(_Branchy(), split_points=["out"], devices=["cpu"] * 2, tracer="export",
             sample=(torch.randn(4, 4),))  # fmt: skip
    return seen


def test_neither_tracer_prints_mpstreams_error_not_torchs_graph_dump(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    with pytest.raises(TypeError) as info:
        Pipe(_Branchy(), split_points=["out"], devices=["cpu"] * 2, sample=(torch.randn(4, 4),))
    message = str(info.value)
    assert "torch.export could not export _Branchy inside submodule 'gate'" in message
    assert len(message.splitlines()) == 3
    err = capfd.readouterr().err
    assert "symbolic_shapes" not in err and "def forward" not in err, err


@pytest.mark.usefixtures("levels")
def test_the_loggers_are_raised_during_the_export_and_restored_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    logging.getLogger(SHAPES).setLevel(logging.NOTSET)  # torch's default: the parent's
    logging.getLogger(DYNAMO).setLevel(logging.WARNING)
    assert _levels_during_export(monkeypatch) == {SHAPES: logging.ERROR, DYNAMO: logging.ERROR}
    assert logging.getLogger(SHAPES).level == logging.NOTSET
    assert logging.getLogger(DYNAMO).level == logging.WARNING


@pytest.mark.usefixtures("levels")
def test_logs_the_user_asked_for_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    logging.getLogger(SHAPES).setLevel(logging.DEBUG)
    logging.getLogger(DYNAMO).setLevel(logging.NOTSET)
    assert _levels_during_export(monkeypatch) == {SHAPES: logging.DEBUG, DYNAMO: logging.ERROR}
    assert logging.getLogger(DYNAMO).level == logging.NOTSET
    # With TORCH_LOGS set, torch's logging is the user's: none is touched.
    monkeypatch.setenv("TORCH_LOGS", "dynamic")
    assert _levels_during_export(monkeypatch) == {SHAPES: logging.DEBUG, DYNAMO: logging.NOTSET}


def test_what_the_module_writes_to_stderr_during_the_export_still_comes_out(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    stderr = sys.stderr
    pipe = Pipe(_Talks(), split_points=["b"], devices=["cpu"] * 2, tracer="export",
                sample=(torch.randn(4, 4),))  # fmt: skip
    assert pipe.split_report().tracer == "torch.export"
    assert capfd.readouterr().err.splitlines() == ["the module's own line"]
    assert sys.stderr is stderr  # put back


def _in_thread(body: Any) -> threading.Thread:
    thread = threading.Thread(target=body)
    thread.start()
    return thread


def test_other_threads_write_to_stderr_while_an_export_holds_its_own(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    with quiet_export():
        print("the export's line", file=sys.stderr)
        _in_thread(lambda: print("a progress bar's line", file=sys.stderr)).join()
        assert capsys.readouterr().err == "a progress bar's line\n"  # not held
    assert capsys.readouterr().err == "the export's line\n"


@pytest.mark.usefixtures("levels")
def test_exports_in_two_threads_that_end_out_of_order_each_hold_their_own(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    logging.getLogger(SHAPES).setLevel(logging.WARNING)
    stderr = sys.stderr
    entered, first_done = threading.Event(), threading.Event()
    levels: list[int] = []

    def second() -> None:
        with quiet_export():
            entered.set()
            first_done.wait(10)
            levels.append(logging.getLogger(SHAPES).level)  # still raised for this one
            print("the second export's line", file=sys.stderr)

    with quiet_export():
        thread = _in_thread(second)
        entered.wait(10)
        print("the first export's line", file=sys.stderr)
    first_done.set()
    thread.join(10)
    assert levels == [logging.ERROR]
    assert logging.getLogger(SHAPES).level == logging.WARNING
    assert sys.stderr is stderr
    assert capsys.readouterr().err.splitlines() == [
        "the first export's line",
        "the second export's line",
    ]

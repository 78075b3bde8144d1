"""mpstream.profile: every task of a pipeline, timed (host clock on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.observe.fitting import fit
from mpstream.observe.profiling import _numbered_from, pipes_in, profile
from mpstream.observe.timeline import Span
from tests.helpers import mlp


def pipe3() -> Pipe:
    return Pipe(mlp([6, 8, 8, 4]), chunks=4, balance=[2, 2, 2], devices=["cpu"] * 3)


def test_plain_forward_and_backward_are_traced() -> None:
    pipe = pipe3()
    x = torch.randn(8, 6, dtype=torch.float64)
    with profile(pipe) as prof:
        for _ in range(2):
            pipe(x).sum().backward()
    assert prof.runs() == [1, 2]
    for run in (1, 2):
        got = {(s.kind, s.stage, s.micro) for s in prof.spans if s.run == run}
        expected = {(k, s, m) for k in ("forward", "backward") for s in range(3) for m in range(4)}
        assert got == expected
    for span in prof.spans:
        assert span.stream == f"stage{span.stage}.compute@cpu"
        assert span.end_ms >= span.start_ms
    # A stage's backward of a micro-batch starts after its forward ended.
    fwd = {(s.stage, s.micro, s.run): s for s in prof.spans if s.kind == "forward"}
    for s in prof.spans:
        if s.kind == "backward":
            assert s.start_ms >= fwd[(s.stage, s.micro, s.run)].end_ms
    summary = prof.summary(echo=False)
    assert len(summary.stage_busy_ms) == 3 and 0 <= summary.bubble_fraction < 1
    assert not pipe.scheduler.timing, "timing must be switched back off"
    assert pipe.scheduler.timings() == []


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_train_step_tasks_are_traced(schedule: str, tmp_path: Path) -> None:
    pipe = Pipe(mlp([6, 8, 4]), chunks=3, balance=[2, 2], devices=["cpu", "cpu"], schedule=schedule)
    x, y = torch.randn(6, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    with profile(pipe) as prof:
        pipe.train_step(x, y, nn.MSELoss())
    kinds = [(s.kind, s.stage, s.micro) for s in prof.spans]
    assert sorted(kinds) == sorted(
        (k, s, m) for k in ("forward", "backward") for s in range(2) for m in range(3)
    )
    doc = json.loads(prof.export_chrome_trace(tmp_path / "t.json").read_text())
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert {"stage0.compute@cpu", "stage1.compute@cpu"} <= tracks
    assert prof.plot(tmp_path / "t.png").exists()


def test_pipes_are_found_inside_models() -> None:
    from mpstream.tutorial import StreamPipelineResNet50

    model = StreamPipelineResNet50("cpu", "cpu", split_size=4, num_classes=10)
    assert pipes_in(model) == [model.__dict__["pipe"]]
    outer = nn.Sequential(pipe3(), nn.Linear(4, 4))
    assert len(pipes_in(outer)) == 1
    with pytest.raises(ValueError, match="contains no mpstream.Pipe"):
        with profile(nn.Linear(2, 2)):
            pass
    with pytest.raises(TypeError, match=r"profile takes a Pipe .* got list .*ModuleList"):
        with profile([pipe3()]):  # type: ignore[arg-type]
            pass


def test_profile_is_empty_until_the_block_ends(tmp_path: Path) -> None:
    pipe = pipe3()
    with profile(pipe) as prof:
        pipe(torch.randn(4, 6, dtype=torch.float64))
        assert prof.recording and prof.spans == []
        # Read too early, it says when it fills, not that nothing ran.
        for read in (
            prof.summary,
            lambda: prof.plot(tmp_path / "never.png"),
            lambda: prof.export_chrome_trace(tmp_path / "never.json"),
            lambda: fit(prof),
        ):
            with pytest.raises(RuntimeError, match="filled when its `with mpstream.profile"):
                read()
    assert not prof.recording and len(prof.spans) == 12
    assert prof.summary(echo=False).runs == 1 and fit(prof).stage_times


def test_two_pipes_get_separate_tracks() -> None:
    model = nn.Sequential(pipe3(), Pipe(mlp([4, 4]), chunks=2))
    with profile(model) as prof:
        model(torch.randn(4, 6, dtype=torch.float64))
    assert {s.stream.split("/")[0] for s in prof.spans} == {"pipe0", "pipe1"}
    # Stages numbered one after another: pipe1's stage 0 is not pipe0's.
    assert prof.meta["pipe_stages"] == [[0, 3], [3, 5]]
    assert prof.stages == 5
    assert {s.stage for s in prof.spans if s.stream.startswith("pipe1/")} == {3, 4}
    assert len(prof.summary(echo=False).stage_busy_ms) == 5
    assert len(fit(prof).stage_times) == 5


def test_a_later_pipes_copies_are_numbered_after_the_earlier_pipes_stages() -> None:
    start = Span(-1, 0, "copy", "io", 0.0, 1.0)  # the input to stage 0
    hop = Span(1, 0, "copy", "copy", 0.0, 1.0)  # stage 1 to 2
    back = Span(0, 0, "copy_grad", "copy", 0.0, 1.0, peer=2)  # a skip's gradient, 2 to 0
    assert _numbered_from(start, 3).stages == (3,)
    assert _numbered_from(hop, 3).stages == (4, 5)
    assert _numbered_from(back, 3).stages == (5, 3)


def test_profile_blocks_do_not_nest() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), chunks=2)
    x = torch.randn(4, 2)
    with profile(pipe) as outer:
        pipe(x)
        with pytest.raises(ValueError, match="profile blocks do not nest"):
            with profile(pipe):
                pass
        pipe(x)
    assert len(outer.runs()) == 2  # the outer block kept every run


class _Fails(nn.Module):
    """Raises at its second micro-batch while ``armed``."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.armed and self.calls == 2:
            raise RuntimeError("boom")
        return x


@pytest.mark.parametrize("step", [False, True])
def test_a_failed_run_leaves_no_spans(step: bool) -> None:
    fails = _Fails()
    pipe = Pipe(
        nn.Sequential(nn.Linear(6, 8), fails, nn.Linear(8, 4)),
        chunks=3,
        balance=[1, 2],
        devices=["cpu", "cpu"],
    )
    x, y = torch.randn(6, 6), torch.randn(6, 4)

    def run() -> None:
        fails.calls = 0
        if step:
            pipe.train_step(x, y, nn.MSELoss())
        else:
            pipe(x)

    with profile(pipe) as prof:
        run()
        fails.armed = True
        with pytest.raises(RuntimeError, match="boom"):
            run()
        fails.armed = False
        run()
    # Its partial spans would be averaged with whole runs by summary().
    assert prof.runs() == [1, 3]
    assert prof.summary(echo=False).runs == 2
    first, last = (sorted((s.kind, s.stage, s.micro) for s in prof.select(r).spans) for r in (1, 3))
    assert first == last


def _failing_once(monkeypatch: pytest.MonkeyPatch, pipe: Pipe, name: str) -> None:
    """``pipe.scheduler.<name>()`` raises ``RuntimeError("parse failed")`` once."""
    method = getattr(pipe.scheduler, name)
    calls = [0]

    def failing() -> object:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("parse failed")
        return method()

    monkeypatch.setattr(pipe.scheduler, name, failing)


@pytest.mark.parametrize("body_raises", [False, True])
def test_a_collection_that_raises_ends_the_profile_and_a_new_one_works(
    monkeypatch: pytest.MonkeyPatch, body_raises: bool
) -> None:
    pipe = pipe3()
    x = torch.randn(8, 6, dtype=torch.float64)
    _failing_once(monkeypatch, pipe, "timings")
    # The block's own error stays the one raised, the collection's a note.
    error = KeyboardInterrupt if body_raises else RuntimeError
    with pytest.raises(error) as raised:
        with profile(pipe) as prof:
            pipe(x)
            if body_raises:
                raise KeyboardInterrupt
    if body_raises:
        assert any("parse failed" in n for n in getattr(raised.value, "__notes__", []))
    assert not prof.recording and prof.spans == [] and not pipe.scheduler.timing
    assert pipe.scheduler.timings() == []  # the run's timings are not held on
    with pytest.raises(RuntimeError, match="holds no timings: collecting them .*parse failed"):
        prof.summary(echo=False)
    with profile(pipe) as again:
        pipe(x)
    assert again.runs() == [1] and len(again.spans) == 12


def test_a_pipe_failing_to_start_timing_leaves_no_pipe_timing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second = pipe3(), pipe3()
    model = nn.ModuleList([first, second])
    _failing_once(monkeypatch, second, "clear_timings")
    with pytest.raises(RuntimeError, match="parse failed"):
        with profile(model):
            pass
    assert not first.scheduler.timing and not second.scheduler.timing
    with profile(model) as prof:  # not refused as nested
        first(torch.randn(8, 6, dtype=torch.float64))
    assert prof.runs() == [1]

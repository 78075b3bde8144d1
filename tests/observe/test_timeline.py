"""Timelines: summaries computed exactly, Chrome traces, Gantt charts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text

from mpstream.observe import figures
from mpstream.observe.timeline import Span, Timeline

STREAMS = {
    "stage0.compute": "cuda:0",
    "stage0.copy": "cuda:0",
    "stage1.compute": "cuda:1",
    "stage1.copy": "cuda:1",
}


def two_stage() -> Timeline:
    spans = [
        Span(0, 0, "forward", "stage0.compute", 0.0, 4.0),
        Span(0, 1, "forward", "stage0.compute", 4.0, 8.0),
        Span(0, 0, "copy", "stage1.copy", 4.0, 6.0),  # fully under stage 0's compute
        Span(1, 0, "forward", "stage1.compute", 6.0, 10.0),
        Span(0, 1, "copy", "stage1.copy", 8.0, 10.0),  # under stage 1's compute
        Span(1, 1, "forward", "stage1.compute", 10.0, 14.0),
        Span(0, 0, "copy_grad", "stage0.copy", 14.0, 16.0),  # nothing computes: exposed
    ]
    return Timeline(spans, dict(STREAMS))


def test_summary_numbers_are_exact() -> None:
    s = two_stage().summary(echo=False)
    assert s.runs == 1
    assert s.makespan_ms == 16.0
    assert s.stage_busy_ms == [8.0, 8.0]
    assert s.bubble_fraction == pytest.approx(1 - 16 / 32)
    assert s.device_idle_fraction == s.bubble_fraction  # one stage per device
    assert s.devices == 2
    assert s.copy_hidden_fraction == pytest.approx(4 / 6)
    assert "device idle" not in str(s) and s.bubble_text() == "bubble 50%"


def test_a_run_with_no_compute_left_its_devices_idle_all_along() -> None:
    copies = [Span(0, 0, "copy", "stage1.copy", 0.0, 2.0)]
    s = Timeline(copies, dict(STREAMS)).summary(echo=False)
    assert s.bubble_fraction == 1.0 and s.device_idle_fraction == 1.0
    assert s.copy_hidden_fraction == 0.0


def test_stages_sharing_a_device_idle_it_only_when_none_computes() -> None:
    # Two stages per device (as interleaved 1F1B and the V schedules place
    # them): a stage waiting while its neighbour on the device computes is
    # no idle device. Stages 0 and 2 on cuda:0 compute 0-4 and 3-7 (busy
    # 0-7 of 10); stages 1 and 3 on cuda:1 compute 4-8 and 6-10 (busy 4-10).
    streams = {f"stage{s}.compute": f"cuda:{s % 2}" for s in range(4)}
    spans = [
        Span(0, 0, "forward", "stage0.compute", 0.0, 4.0),
        Span(2, 0, "forward", "stage2.compute", 3.0, 7.0),
        Span(1, 0, "forward", "stage1.compute", 4.0, 8.0),
        Span(3, 0, "forward", "stage3.compute", 6.0, 10.0),
    ]
    s = Timeline(spans, streams).summary(echo=False)
    assert s.bubble_fraction == pytest.approx(1 - 16 / 40)
    assert s.device_idle_fraction == pytest.approx(1 - (7 + 6) / 20)
    assert s.devices == 2
    assert "device idle: 35.0% (2 devices)" in str(s)
    assert s.bubble_text() == "bubble 60% (device idle 35%)"
    assert s.to_dict()["device_idle_fraction"] == s.device_idle_fraction


def test_summary_averages_runs_and_prints(capsys: pytest.CaptureFixture[str]) -> None:
    first = two_stage().spans
    second = [
        Span(s.stage, s.micro, s.kind, s.stream, s.start_ms + 100, s.end_ms + 100, 2)
        for s in first[:4]
    ]
    s = Timeline(first + second, dict(STREAMS)).summary()
    assert s.runs == 2
    assert s.makespan_ms == pytest.approx((16.0 + 10.0) / 2)
    out = capsys.readouterr().out
    assert (
        "bubble fraction" in out
        and "copy time hidden behind compute" in out
        and "stage 1 busy" in out
    )
    assert s.to_dict()["per_run"][1]["makespan_ms"] == 10.0


def test_no_copies_means_no_hidden_fraction() -> None:
    tl = Timeline([Span(0, 0, "forward", "stage0.compute", 0, 1)], {"stage0.compute": "cpu"})
    assert tl.summary(echo=False).copy_hidden_fraction is None
    with pytest.raises(ValueError, match="empty"):
        Timeline([], {}).summary()


def test_chrome_trace_has_a_track_per_stream(tmp_path: Path) -> None:
    tl = two_stage()
    path = tl.export_chrome_trace(tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    threads = {
        e["args"]["name"]: (e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"
    }
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert set(threads) == set(STREAMS)
    assert sorted(processes.values()) == ["cuda:0", "cuda:1"]
    for stream, (pid, _) in threads.items():
        assert processes[pid] == STREAMS[stream]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(tl.spans)
    for e, span in zip(complete, tl.spans):
        assert (e["pid"], e["tid"]) == threads[span.stream]
        assert e["ts"] == pytest.approx(span.start_ms * 1e3) and e["dur"] == pytest.approx(
            span.duration_ms * 1e3
        )
        assert e["cat"] == span.kind and e["args"]["micro"] == span.micro


def test_plot_writes_a_png(tmp_path: Path) -> None:
    path = two_stage().plot(tmp_path / "gantt.png", title="test")
    assert path.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="empty"):
        Timeline([], {}).plot(tmp_path / "none.png")
    with pytest.raises(ValueError, match=r"no run 0; its runs: \[1\]"):
        two_stage().plot(tmp_path / "none.png", run=0)


def test_plot_returns_the_file_it_wrote(tmp_path: Path) -> None:
    # A name without a suffix: matplotlib writes gantt.png, and plot
    # returned tmp_path / "gantt", a file that did not exist.
    assert two_stage().plot(tmp_path / "gantt") == tmp_path / "gantt.png"
    assert (tmp_path / "gantt.png").read_bytes().startswith(b"\x89PNG")
    assert two_stage().plot(tmp_path / "gantt.pdf").read_bytes().startswith(b"%PDF")
    # A folder: the figure went beside it, as <folder>.png.
    folder = tmp_path / "out"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"out is a folder: give the figure's file, such as"):
        two_stage().plot(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gantt.pdf", "gantt.png", "out"]


def test_a_long_title_stays_clear_of_the_legend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The doctor's titles run across the figure; the legend once sat on them.
    drawn: list[Any] = []
    draw = figures.save

    def save(fig: Any, ax: Any, path: Path, title: str = "", **kw: Any) -> Path:
        drawn.append(ax)
        return draw(fig, ax, path, title, **kw)

    monkeypatch.setattr(figures, "save", save)
    heading = "a long title " * 12
    two_stage().plot(tmp_path / "gantt.png", title=heading)
    (ax,) = drawn
    canvas = FigureCanvasAgg(ax.figure)  # the saved layout, drawn again after close
    canvas.draw()
    renderer = canvas.get_renderer()
    (text,) = [t for t in ax.get_children() if isinstance(t, Text) and t.get_text() == heading]
    title = text.get_window_extent(renderer)
    legend = ax.get_legend().get_window_extent(renderer)
    assert not title.overlaps(legend) and title.y0 >= legend.y1


def test_select_and_copy_span_stages() -> None:
    tl = two_stage()
    assert tl.select(1).spans == tl.spans and tl.select(2).spans == []
    assert tl.spans[2].stages == (0, 1)
    assert Span(0, 0, "copy", "x", 0, 1).stages == (0, 1)
    assert Span(-1, 0, "copy", "x", 0, 1).stages == (0,)
    assert tl.spans[-1].stages == (1, 0)


def test_a_copy_is_hidden_by_any_stage_on_its_devices() -> None:
    # Stage 2 shares device a with stage 0: its compute hides 0 -> 1's copy.
    spans = [
        Span(0, 0, "forward", "s0", 0.0, 1.0),
        Span(2, 0, "forward", "s2", 1.0, 3.0),
        Span(1, 0, "forward", "s1", 3.0, 4.0),
        Span(0, 0, "copy", "c01", 1.0, 3.0, peer=1),
    ]
    devices = {"s0": "a", "s2": "a", "s1": "b", "c01": "a"}
    summary = Timeline(spans, devices).summary(echo=False)
    assert summary.copy_hidden_fraction == 1.0

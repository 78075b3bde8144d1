"""Host time by kind (:mod:`mpstream.observe.hostwork`): events named as the
profiler names them are sorted into kinds, each moment of a thread goes to
its innermost event, the step's thread idle while another works is waiting;
a profiled step over emulated graphed stages adds up to its profiled time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks import replay_profile
from mpstream import Pipe
from mpstream.observe.hostwork import Breakdown, Interval, attribute, host_breakdown, kind_of
from mpstream.runtime.graphed import Emulated
from tests.helpers import mlp


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("cudaGraphLaunch", "graph launch"),
        ("cudaGraphLaunch_v10000", "graph launch"),
        ("cudaLaunchKernel", "kernel launch"),
        ("cudaLaunchKernelExC", "kernel launch"),
        ("cuLaunchKernel", "kernel launch"),
        ("cudaMemcpyAsync", "kernel launch"),
        ("cudaMemsetAsync", "kernel launch"),
        ("cudaEventRecord", "event record/wait"),
        ("cudaEventRecordWithFlags", "event record/wait"),
        ("cudaStreamWaitEvent", "event record/wait"),
        ("cudaStreamSynchronize", "synchronize"),
        ("cudaEventSynchronize", "synchronize"),
        ("cudaDeviceSynchronize", "synchronize"),
        ("cudaStreamIsCapturing", "other CUDA API"),
        ("cuModuleGetFunction", "other CUDA API"),
        ("aten::addmm", "aten"),
        ("mpstream::record", "aten"),
        ("autograd::engine::evaluate_function: AddmmBackward0", "autograd"),
        ("AddmmBackward0", "autograd"),
        ("ReplayBackward", "autograd"),  # a custom autograd Function's node
        ("torch::autograd::AccumulateGrad", "autograd"),
        ("mpstream/forward/stage0/mb1", "mpstream"),
        ("mpstream/host/step", None),
        ("my own range", None),
        ("culture", None),
    ],
)
def test_profiler_event_names_map_to_their_kind(name: str, kind: str | None) -> None:
    assert kind_of(name) == kind


def _iv(thread: int, start: float, end: float, name: str) -> Interval:
    return Interval(thread, start, end, kind_of(name), name)


def test_each_moment_goes_to_the_innermost_event_and_idle_time_is_python_or_waiting() -> None:
    events = [
        _iv(1, 10, 40, "aten::conv2d"),
        _iv(1, 20, 25, "cudaLaunchKernel"),  # inside the operator
        _iv(1, 50, 90, "mpstream/backward/stage1/mb0"),
        _iv(1, 60, 70, "cudaGraphLaunch"),
        _iv(1, 60, 62, "cudaEventRecord"),  # starts with the launch, ends first
        _iv(1, 75, 80, "Replay"),  # no kind: transparent, the range around it shows
        _iv(2, 92, 99, "autograd::engine::evaluate_function: AddmmBackward0"),
        _iv(2, 94, 96, "aten::mm"),
        _iv(1, 150, 160, "aten::add_"),  # between the steps: not counted
        _iv(1, 200, 210, "my own range"),  # no kind: Python inside it
    ]
    got = attribute(events, [(0, 100), (180, 220)], main=1)
    assert got == pytest.approx(
        {
            "aten": 25 + 2,  # 10-20 and 25-40; thread 2's 94-96
            "kernel launch": 5,
            "mpstream": 30,  # 50-60, 70-90
            "graph launch": 8,  # 62-70: the record is innermost for 60-62
            "event record/wait": 2,
            "autograd": 5,  # 92-94, 96-99
            "waiting": 7,  # thread 1 idle in 90-100 while thread 2 works 92-99
            "python": 10 + 10 + 10 - 7 + 40,  # 0-10, 40-50, 90-100 less waiting; step 2
        }
    )


def test_waiting_is_the_main_threads_idle_time_shared_with_other_threads_many_spans() -> None:
    # Thousands of spans on each side: one pass over both, not every pair.
    n = 20000
    events = [_iv(1, 10 * i, 10 * i + 4, "aten::mul") for i in range(n)]
    events += [_iv(2, 10 * i + 2, 10 * i + 7, "aten::mm") for i in range(n)]
    got = attribute(events, [(0, 10 * n)], main=1)
    assert got["waiting"] == pytest.approx(3 * n)  # 4-7 of each 10: idle here, busy there
    assert got["python"] == pytest.approx(3 * n)  # 7-10
    assert got["aten"] == pytest.approx(4 * n + 5 * n)


def test_a_thread_with_no_event_in_a_step_is_all_python() -> None:
    assert attribute([], [(0, 50)], main=3) == {"python": 50}


def test_a_profiled_step_over_emulated_graphed_stages_adds_up(tmp_path: Path) -> None:
    pipe = Pipe(mlp([6, 8, 8, 4]), chunks=4, balance=[2, 4], devices=["cpu"] * 2,
                graphs=Emulated())  # fmt: skip
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    trace = tmp_path / "trace.json"
    b = host_breakdown(lambda: pipe.train_step(x, y, nn.MSELoss()), tasks=16, steps=3,
                       warmup=2, trace=str(trace))  # fmt: skip
    assert b.tasks == 16 and b.steps == 3 and b.issue_us > 0 and b.step_us >= b.issue_us
    # One thread: its kinds are its whole profiled step, on average (the
    # median, profiled_us, drifts with a shared machine's load).
    events = json.loads(trace.read_text())["traceEvents"]
    windows = [e["dur"] for e in events if e.get("name") == "mpstream/host/step"]
    assert len(windows) == 3
    assert sum(b.kinds.values()) == pytest.approx(sum(windows) / 3, rel=0.02)
    assert {"aten", "mpstream", "python"} <= set(b.kinds) and "waiting" not in b.kinds
    assert b.counts["operators"] > 0 and "graph launch" not in b.counts  # nothing on a GPU
    assert sum(b.per_task().values()) == pytest.approx(sum(b.kinds.values()) / 16)
    assert json.dumps(b.to_json())  # plain values


def test_bad_arguments_are_refused_before_anything_runs() -> None:
    ran = []
    with pytest.raises(ValueError, match="tasks=0"):
        host_breakdown(lambda: ran.append(1), tasks=0)
    with pytest.raises(ValueError, match="warmup=-1"):
        host_breakdown(lambda: ran.append(1), tasks=1, warmup=-1)
    assert ran == []


def test_the_replay_profile_script_writes_its_table_and_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = Breakdown(16, 2, 900.0, 1000.0, 1200.0, {"graph launch": 320.0, "python": 800.0},
                     {"graph launch": 16.0, "operators": 40.0}, {}, 1.0)  # fmt: skip
    written: list[str] = []

    def measure(args: Any, device: Any, done: Any) -> Any:
        results, warned = {"graphed loop": made}, {"graphed loop": ["GraphWarning: eager"]}
        done(results, warned)  # after each variant: what finished is on disk
        written.append((tmp_path / "replay-profile.md").read_text())
        return results, warned

    monkeypatch.setattr(replay_profile, "measure", measure)
    assert replay_profile.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "replay-profile.json").read_text())
    assert report["cpu"] and report["config"]["batch_size"] == 4
    assert report["variants"]["graphed loop"]["kinds_us_per_task"]["python"] == 50.0
    assert report["warnings"] == {"graphed loop": ["GraphWarning: eager"]}
    table = (tmp_path / "replay-profile.md").read_text()
    assert written == [table]
    assert "| graphed loop | 16 | 0.90 | 1.00 | 90% | 75 | 20.0 | 50.0 | 1.00 |" in table
    assert "- graphed loop: GraphWarning: eager" in table
    assert not (tmp_path / "replay-trace.json.gz").exists()  # made by measure, not here
    # On a GPU, a graphed row that launched no graph is flagged.
    eager = Breakdown(16, 2, 900.0, 1000.0, 1200.0, {"python": 800.0}, {}, {}, 0.0)
    assert replay_profile.suspect({"graphed loop": made}, cuda=True) == []
    assert "ran eagerly" in replay_profile.suspect({"graphed loop": eager}, cuda=True)[0]
    assert replay_profile.suspect({"graphed loop": eager}, cuda=False) == []


def test_the_replay_profile_counts_a_steps_tasks() -> None:
    pipe = Pipe(mlp([6, 8, 4]), split_size=3, balance=[2, 2], devices=["cpu"] * 2)
    x, y = torch.randn(7, 6, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    assert replay_profile._tasks(pipe, x, y, loop=True) == 2 * 2 * 3
    assert replay_profile._tasks(pipe, x, y, loop=False) == 2 * 2 * 3

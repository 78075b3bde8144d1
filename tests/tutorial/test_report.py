"""The bench's report: its table and JSON say what was timed and mark noisy
measurements (a round far from the others), and its figures' error bars run
from the fastest to the slowest round, never below zero."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mpstream.observe import figures
from mpstream.observe.figures import tutorial_figures
from mpstream.tutorial import bench, design, report


def _noisy_run() -> design.Results:
    """The issue's case, faked: one of mpstream's rounds took 15.3 s on a
    busy machine, the others 0.6 s; the other models' rounds agree."""
    cpu = torch.device("cpu")
    cfg = bench.Config(split_size=2, split_sizes=(1, 2), repeat=4)
    steady = [1.10, 1.15, 1.20, 1.15]
    models = [
        design.Measurement("single device", None, steady),
        design.Measurement("model parallel", None, steady),
        design.Measurement("tutorial pipeline", 2, steady),
        design.Measurement("mpstream", 2, [0.58, 0.6, 15.3, 0.6]),
    ]
    sweep = [
        design.Measurement("tutorial pipeline", 1, steady),
        models[2],
        design.Measurement("mpstream", 1, steady),
        models[3],
    ]
    load = {"before": {"load_1min": 0.4, "cpus": 2}, "after": {"load_1min": 3.1, "cpus": 2}}
    return design.Results(cfg, (cpu, cpu), models, sweep, load)


def test_a_noisy_measurement_is_marked_in_the_table() -> None:
    printed = bench.table(_noisy_run())
    rows = {line.split()[0] + line.split()[1]: line for line in printed.splitlines()[2:6]}
    assert "x* single device" in rows["mpstream2"]
    # The pipeline's ratio is against the single device, which is steady.
    assert "x  single device" in rows["tutorialpipeline"]
    assert "4.270*" in printed  # the sweep marks it too (mean of its rounds)
    note = next(line for line in printed.splitlines() if line.startswith("* "))
    assert "1 measurement(s) noisy" in note and "mpstream (split 2)" in note
    assert "rounds 0.580-15.300 s (26.4x" in note and "rerun on a quiet machine" in note
    assert "--repeat" in note
    assert printed.splitlines()[-1] == (
        "machine load (1-minute average): 0.40 before, 3.10 after, on 2 CPUs; "
        "busier than its CPUs: other work competed with the timing"
    )


def test_a_quiet_run_says_no_noise() -> None:
    results = _noisy_run()
    results.models[3].times[:] = [1.0, 1.05, 1.1, 1.0]
    printed = bench.table(results)
    assert "*" not in printed and "noisy" not in printed
    assert printed.endswith(
        "0.40 before, 3.10 after, on 2 CPUs; busier than its CPUs: "
        "other work competed with the timing"
    )
    results.load = {}
    assert "machine load" not in bench.table(results)


def test_the_json_says_which_ratios_are_noisy() -> None:
    doc = report.to_json(_noisy_run())
    by_model = {m["model"]: m for m in doc["models"]}
    assert by_model["mpstream"]["ratio_noisy"] and by_model["mpstream"]["spread"]["noisy"]
    assert by_model["mpstream"]["spread"]["low"] == 0.58
    assert by_model["mpstream"]["spread"]["high"] == 15.3
    assert not by_model["tutorial pipeline"]["ratio_noisy"]
    assert doc["noise"]["noisy"] == ["mpstream (split 2)"]
    assert doc["noise"]["max_cv"] == 0.15 and "quiet machine" in doc["noise"]["note"]
    assert doc["load"]["after"]["load_1min"] == 3.1
    json.dumps(doc)  # JSON-serialisable as written


def test_error_bars_never_go_below_zero_and_noisy_bars_are_marked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn: dict[str, Any] = {}
    draw = figures.save

    def save(fig: Any, ax: Any, path: Path, title: str = "", **kw: Any) -> Path:
        drawn[path.name] = (ax, title, [t.get_text() for t in ax.get_xticklabels()])
        return draw(fig, ax, path, title, **kw)

    monkeypatch.setattr(figures, "save", save)
    tutorial_figures(_noisy_run(), tmp_path)
    ax, title, labels = drawn["mp_vs_rn_vs_pp.png"]
    assert figures.NOISY_NOTE in title
    assert labels[-1].endswith(" *") and not labels[0].endswith("*")
    assert ax.get_ylim()[0] == 0
    # Every error bar's lowest point is the fastest round, never below zero.
    segments = [c for c in ax.collections if hasattr(c, "get_segments")]
    lows = [min(y for _, y in seg) for c in segments for seg in c.get_segments()]
    assert lows and min(lows) == pytest.approx(0.58) and min(lows) >= 0
    _, title, _ = drawn["split_size_tradeoff.png"]
    assert figures.NOISY_NOTE in title
    _, title, _ = drawn["mp_vs_rn.png"]
    assert figures.NOISY_NOTE not in title  # both steady
    # A standard deviation drawn both ways would have gone below zero here.
    m = _noisy_run().models[3]
    assert m.mean - m.std < 0 < m.spread.low


def test_error_bars_from_bounds() -> None:
    assert figures.error_bars([1.0, 2.0], [(0.5, 1.5), (2.5, 3.0)]) == [[0.5, 0.0], [0.5, 1.0]]


def test_the_table_says_what_is_timed_and_that_cpu_numbers_are_not_gpu_numbers() -> None:
    cfg = bench.Config(num_batches=2, batch_size=4, image_w=32, image_h=48, repeat=3, warmup=1)
    cpu, gpu = torch.device("cpu"), torch.device("cuda:0")
    models = [design.Measurement("single device", None, [1.0, 1.1, 1.0])]
    on_cpu = bench.table(design.Results(cfg, (cpu, cpu), models, [])).splitlines()
    timed = "each time: one synchronised train() call, in seconds (2 batches of 4 images of 32x48"
    assert any(line.startswith(timed) for line in on_cpu)
    assert any("3 rounds after 1 warm-up" in line for line in on_cpu)
    assert any(line.startswith("CPU: ") and "not GPU numbers" in line for line in on_cpu)
    on_gpu = bench.table(design.Results(cfg, (gpu, gpu), models, []))
    assert timed in on_gpu and "not GPU numbers" not in on_gpu
    one = dataclasses.replace(cfg, num_batches=1)
    assert "(1 batch of 4 images" in bench.table(design.Results(one, (cpu, cpu), models, []))

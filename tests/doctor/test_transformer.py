"""``mpstream doctor --model transformer`` on the CPU: the ResNet steps'
checks on the transformer workload, its report and what it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpstream.doctor import Options, run
from mpstream.doctor.diagnosis import TINY
from mpstream.doctor.runner import TRANSFORMER_STEPS


def test_the_transformer_doctor_runs_every_step_it_can_on_the_cpu(tmp_path: Path) -> None:
    lines: list[str] = []
    code = run(
        Options(out=tmp_path, arch="transformer", sizes=TINY, progress=False), echo=lines.append
    )
    assert code == 0, "\n".join(lines)
    assert "transformer tiny" in lines[0]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["arch"] == "transformer" and report["preset"] == "tiny"
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == [s.name for s in TRANSFORMER_STEPS]
    assert [steps[n]["status"] for n in ("overlap", "races")] == ["SKIP", "SKIP"]  # CUDA only
    # Every schedule x checkpoint mode x 2 micro-batch counts.
    assert steps["correctness"]["figure"].startswith("48/48 cases equal the unsplit model")
    assert "1f1b stage 0 activations" in steps["memory"]["figure"]
    assert "CPU: nothing overlaps" in steps["experiment"]["figure"]
    predictions = steps["cost-model"]["data"]["predictions"]
    assert [p["gpus"] for p in predictions] == [2, 4]  # 8 GPUs need 8 blocks
    assert all(p["per_device_bytes"] for p in predictions)
    details = [c["detail"] for c in steps["cost-model"]["checks"]]
    assert any("a GPU target, from the CPU's costs" in d for d in details)
    for name in ("transformer.json", "transformer_throughput.png", "transformer_memory.png",
                 "transformer_timeline.png"):  # fmt: skip
        assert (tmp_path / name).exists(), name


def test_what_the_transformer_doctor_refuses(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--preset sizes the transformer"):
        run(Options(out=tmp_path, preset="tiny", sizes=TINY))
    with pytest.raises(ValueError, match="--batch-size: the tutorial's experiment's"):
        run(Options(out=tmp_path, arch="transformer", batch_size=8, sizes=TINY))
    with pytest.raises(ValueError, match="unknown step.*tutorial for transformer"):
        run(Options(out=tmp_path, arch="transformer", skip=("tutorial",), sizes=TINY))
    with pytest.raises(ValueError, match="unknown transformer preset 'huge'"):
        run(Options(out=tmp_path, arch="transformer", preset="huge", sizes=TINY))

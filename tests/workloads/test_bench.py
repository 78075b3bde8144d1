"""``mpstream bench --model transformer`` on the CPU: every configuration
timed side by side, its memory per stage measured, labelled as the CPU's."""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mpstream import cli
from mpstream.tutorial import rounds
from mpstream.workloads import bench, memory, report, transformer

CPU = torch.device("cpu")


def quick() -> bench.Config:
    p = transformer.preset("tiny", repeat=1, warmup=1, micro_batches=(2,))
    return bench.Config(p, (CPU, CPU), hf=False)


def test_every_configuration_is_timed_with_its_memory_per_stage(tmp_path: Path) -> None:
    config = quick()
    ticks: list[int] = []
    results = bench.run(config, tick=lambda: ticks.append(1))
    keys = [(bench.SINGLE, None, None), (bench.NAIVE, None, None)] + [
        ("mpstream", s, 2) for s in bench.SCHEDULES
    ]
    assert list(results.measured) == keys  # graphed stages: on GPUs only
    twice = bench.Config(transformer.preset("tiny", micro_batches=(2, 2)), (CPU, CPU), hf=False)
    assert bench.keys_for(twice) == keys  # a count given twice is timed once
    assert len(ticks) == len(keys) * 2
    p = config.preset
    params = transformer.decoder(p)
    per_layer = [sum(x.numel() * 4 for x in layer.parameters()) for layer in params]
    halves = transformer.halves(p)
    stages = [sum(per_layer[: halves[0]]), sum(per_layer[halves[0] :])]
    for key, m in results.measured.items():
        expected = [sum(stages)] if key[0] == bench.SINGLE else stages
        assert [s["parameters"] for s in m.memory] == expected
        assert [s["gradients"] for s in m.memory] == expected
        assert [s["optimizer"] for s in m.memory] == [2 * b + 4 * n for b, n in zip(
            expected, [sum(1 for _ in params.parameters())] if key[0] == bench.SINGLE
            else _counts(params, halves))]  # fmt: skip
        assert all(s["activations"] > 0 for s in m.memory)
        assert m.device_peaks == {}  # allocator statistics: on a GPU only
    data = report.to_json(results)
    assert data["cpu"] and all(row["mfu"] is None for row in data["rows"])
    assert data["rows"][0]["vs_single_device"] == 1.0
    text = report.table(results)
    assert "naive model parallel" in text
    assert any(line.startswith("CPU: every stage runs") for line in text.splitlines())
    assert set(data["meta"]["load"]) == {"before", "after"}
    written = report.save(results, tmp_path)
    assert [p.name for p in written] == [
        "transformer.json",
        "transformer_throughput.png",
        "transformer_memory.png",
    ]
    assert json.loads(written[0].read_text())["preset"]["name"] == "tiny"


def _counts(model: torch.nn.Sequential, halves: list[int]) -> list[int]:
    """Parameters (tensors) per stage: AdamW keeps a step count for each."""
    layers = list(model)
    first = sum(1 for layer in layers[: halves[0]] for _ in layer.parameters())
    return [first, sum(1 for _ in model.parameters()) - first]


def test_the_hugging_face_model_runs_through_the_export_split() -> None:
    pytest.importorskip("transformers")
    p = transformer.preset("tiny", repeat=1, warmup=1, micro_batches=(2,))
    keys = bench.keys_for(bench.Config(p, (CPU, CPU)))
    assert (bench.HF, "1f1b", 2) in keys
    runner = bench._Runner((bench.HF, "1f1b", 2), bench.Config(p, (CPU, CPU)))
    runner.step()
    assert "torch.export" in str(runner.module.split_report())  # type: ignore[operator]


def trained(p: transformer.Preset) -> tuple[torch.nn.Sequential, torch.optim.AdamW, Any]:
    """The tiny decoder, its AdamW and one step of plain training."""
    model = transformer.decoder(p)
    opt = torch.optim.AdamW(model.parameters())
    x, y = transformer.tokens(p)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        transformer.loss_fn(model(x), y).backward()
        opt.step()

    return model, opt, step


def test_memory_of_a_stage_counts_what_it_saves_for_backward() -> None:
    p = transformer.preset("tiny")
    model, opt, step = trained(p)
    step()
    (stage,), peaks = memory.per_stage(model, opt, step, [CPU])
    assert peaks == {}
    # At least every block's input and attention's output, float32, whole batch.
    assert stage["activations"] >= 2 * p.depth * p.batch * p.seq * p.width * 4


def test_the_command_runs_the_transformer_and_refuses_the_tutorial_s_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--model", "transformer", "--quick", "--repeat", "1", "--warmup", "1",
            "--micro-batches", "2", "--no-plots", "--no-progress",
            "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "transformer tiny" in out and "mpstream 1f1b, 2 micro-batches" in out
    assert (tmp_path / "transformer.json").exists()
    assert cli.main([*argv, "--split-size", "4"]) == 2
    assert "--split-size: options of the tutorial's experiment" in capsys.readouterr().err


def test_configurations_that_do_not_all_fit_are_timed_in_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A device that holds three configurations (a 1b one's weights, grads and
    # AdamW state are 17.6 GB: an H200 holds a few of the fifteen). A timed
    # group must be freed for the next: nothing may keep its runners alive.
    live: weakref.WeakSet[bench._Runner] = weakref.WeakSet()

    class Tight(bench._Runner):
        def __init__(self, key: bench.Key, config: bench.Config) -> None:
            if len(live) >= 3:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (a full device)")
            super().__init__(key, config)
            live.add(self)

    monkeypatch.setattr(bench, "_Runner", Tight)
    results = bench.run(quick())
    groups = [m.group for m in results.measured.values()]
    assert groups == [0, 0, 0, 1, 1]
    assert all(m.memory and len(m.times) == 1 for m in results.measured.values())


def test_graphed_stages_that_run_eagerly_are_not_timed_as_graphed() -> None:
    def runner(reason: str) -> bench._Runner:
        stage = SimpleNamespace(stage=1, graphed=False, reason=reason)
        report = SimpleNamespace(stages=[stage])
        return SimpleNamespace(pipe=SimpleNamespace(graph_report=lambda: report))  # type: ignore[return-value]

    key = (bench.GRAPHED, "1f1b", 2)
    with pytest.raises(rounds.NoRoom, match="stage 1 runs eagerly"):  # a later group
        bench._eager(key, runner("CUDA out of memory. Tried to allocate 2.00 GiB"))
    why = bench._eager(key, runner("operation not permitted when stream is capturing"))
    assert why == "stage 1 runs eagerly (operation not permitted when stream is capturing)"
    assert bench._eager(("mpstream", "1f1b", 2), runner("eager by design")) == ""
    config = quick()
    steady = [0.1, 0.1]
    measured = {k: bench.Measured(k, steady, []) for k in bench.keys_for(config)}
    measured[key] = bench.Measured(key, steady, [], eager=why)
    text = report.table(bench.Results(config, measured, {"load": {}}))
    assert f"! {bench.label(key)}: {why}: an eager step's times, not graphed" in text


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989.4),
        ("NVIDIA H200 NVL", 835.5),
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 NVL", 835.5),
        ("NVIDIA H100 PCIe", 756.0),
        ("Some Other GPU", None),
    ],
)
def test_the_peak_is_the_part_s_own(
    name: str, peak: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An H200 NVL read as an SXM H200 would understate MFU by 16%.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert bench.peak_tflops(torch.device("cuda", 0)) == peak
    assert bench.peak_tflops(torch.device("cpu")) is None


def test_a_configuration_the_device_cannot_hold_is_left_out_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 3b on one H200: the single device cannot hold what the pipelines do.
    single = (bench.SINGLE, None, None)

    class Big(bench._Runner):
        def __init__(self, key: bench.Key, config: bench.Config) -> None:
            if key == single:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")
            super().__init__(key, config)

    monkeypatch.setattr(bench, "_Runner", Big)
    results = bench.run(quick())
    assert single not in results.measured and len(results.measured) == 4
    assert results.unfit[single].startswith("does not fit in device memory even alone (CUDA")
    data = report.to_json(results)
    assert all(row["vs_single_device"] is None for row in data["rows"])
    assert all(row["vs_naive_model_parallel"] is not None for row in data["rows"])
    assert data["unfit"] == [{"configuration": bench.label(single), "why": results.unfit[single]}]
    text = report.table(results)
    assert f"! {bench.label(single)}: does not fit in device memory even alone" in text
    assert len(report.save(results, tmp_path)) == 3  # the JSON and both figures, without it


def test_an_interrupted_bench_reports_and_saves_what_it_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    timed = bench._Runner.timed

    def stop_at_the_fourth(runner: bench._Runner) -> float:
        calls.append(1)
        if len(calls) == 4:  # the warm-ups of the first three, then Ctrl-C
            raise KeyboardInterrupt
        return timed(runner)

    monkeypatch.setattr(bench._Runner, "timed", stop_at_the_fourth)
    with pytest.raises(KeyboardInterrupt):  # the library's default: the doctor's too
        bench.run(quick())
    calls.clear()
    results = bench.run(quick(), interruptible=True)
    assert results.interrupted and results.measured == {}
    assert len(results.not_timed()) == 5
    data = report.to_json(results)
    assert data["interrupted"] and len(data["not_timed"]) == 5
    (tmp_path / "transformer_memory.png").write_bytes(b"an earlier run's")
    assert [p.name for p in report.save(results, tmp_path)] == ["transformer.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["transformer.json"]  # none stale
    said = "! interrupted: the figures are what ran before it; not timed: single device, "
    assert any(line.startswith(said) for line in report.table(results).splitlines())

    calls.clear()
    p = transformer.preset("tiny", repeat=2, warmup=1, micro_batches=(2,))
    config = bench.Config(p, (CPU, CPU), hf=False)

    def stop_in_the_second_round(runner: bench._Runner) -> float:
        calls.append(1)
        if len(calls) == 5 * 2 + 3:  # warm-ups, round 1, three of round 2
            raise KeyboardInterrupt
        return timed(runner)

    monkeypatch.setattr(bench._Runner, "timed", stop_in_the_second_round)
    results = bench.run(config, interruptible=True)
    assert len(results.measured) == 5 and results.not_timed() == []
    text = report.table(results)
    assert "! interrupted: the figures are what ran before it; fewer than 2 rounds: " in text
    assert len(report.save(results, tmp_path)) == 3


def test_the_command_stops_on_sigterm_as_on_ctrl_c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import os
    import signal

    before = signal.getsignal(signal.SIGTERM)
    run = bench.run

    def terminated(config: bench.Config, **kwargs: object) -> bench.Results:
        def timed(runner: bench._Runner) -> float:
            os.kill(os.getpid(), signal.SIGTERM)  # what `timeout` sends
            return 0.0

        monkeypatch.setattr(bench._Runner, "timed", timed)
        return run(config, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(bench, "run", terminated)
    argv = ["bench", "--model", "transformer", "--quick", "--repeat", "1", "--warmup", "1",
            "--micro-batches", "2", "--no-plots", "--no-progress",
            "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 130
    assert "interrupted: the results are partial" in capsys.readouterr().err
    assert json.loads((tmp_path / "transformer.json").read_text())["interrupted"]
    assert signal.getsignal(signal.SIGTERM) is before

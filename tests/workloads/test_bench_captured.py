"""``mpstream bench --model transformer``'s graphed baseline on the CPU: the
single device captured whole (:class:`~mpstream.capture.CapturedStep`), its
memory, a capture that fails, and the like-with-like ratios graphed rows read
against it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mpstream.workloads import bench, memory, report, transformer
from tests.workloads.test_bench import CPU, quick, trained


def test_graphed_stages_are_compared_with_the_single_device_captured_whole() -> None:
    p = transformer.preset("tiny", micro_batches=(2,))
    gpus = (torch.device("cuda", 0), torch.device("cuda", 0))
    captured = (bench.CAPTURED, None, None)
    keys = bench.keys_for(bench.Config(p, gpus, hf=False))
    assert keys[:3] == [(bench.SINGLE, None, None), (bench.NAIVE, None, None), captured]
    assert (bench.GRAPHED, "1f1b", 2) in keys
    assert captured not in bench.keys_for(bench.Config(p, gpus, graphed=False, hf=False))
    assert captured not in bench.keys_for(bench.Config(p, (CPU, CPU), hf=False))
    # On the CPU CapturedStep runs the step eagerly: the same training as
    # the single device's (zeroing, train_step, AdamW) on the same weights.
    config = quick()
    single = bench._Runner((bench.SINGLE, None, None), config)
    whole = bench._Runner(captured, config)
    assert whole.captured is not None and not whole.captured.captured and whole.graph_bytes == 0
    assert whole.devices == [CPU] and whole.eager == ""
    for _ in range(2):
        single.step()
        whole.step()
    torch.testing.assert_close(
        list(whole.module.parameters()), list(single.module.parameters()), rtol=1e-5, atol=1e-6
    )


def test_the_captured_single_device_is_timed_with_its_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    captured = (bench.CAPTURED, None, None)
    monkeypatch.setattr(bench, "keys_for", lambda config: [(bench.SINGLE, None, None), captured])
    held: list[int] = []
    measure = memory.per_stage

    def per_stage(*args: Any) -> Any:
        held.append(args[5])
        return measure(*args)

    monkeypatch.setattr(memory, "per_stage", per_stage)  # bench reads it from there
    config = quick()
    results = bench.run(config)
    # The captured step's activations include its input and target buffers.
    p = config.preset
    assert held == [0, 2 * p.batch * p.seq * 8]
    single, whole = (results.measured[k] for k in results.measured)
    assert [s["parameters"] for s in whole.memory] == [s["parameters"] for s in single.memory]
    assert [s["optimizer"] for s in whole.memory] == [s["optimizer"] for s in single.memory]
    assert whole.memory[0]["activations"] > 0 and whole.eager == ""
    row = report.to_json(results)["rows"][1]
    # Its own like-with-like ratio would be 1: it reads against the eager one.
    assert row["vs_captured_single_device"] is None and row["vs_single_device"] is not None
    assert row["mfu"] is None


def test_a_failed_capture_of_the_single_device_runs_eagerly_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    captured = (bench.CAPTURED, None, None)

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(bench, "CapturedStep", refuse)
    runner = bench._Runner(captured, quick())
    why = "its capture failed (operation not permitted when stream is capturing)"
    assert runner.captured is None and runner.eager == why
    assert bench._eager(captured, runner) == why
    runner.step()  # the pipe's eager step
    assert all(p.grad is not None for p in runner.module.parameters())

    def full(*args: object, **kwargs: object) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(bench, "CapturedStep", full)
    with pytest.raises(torch.cuda.OutOfMemoryError):  # a later group may hold it
        bench._Runner(captured, quick())


def test_graphed_rows_read_against_the_captured_single_device() -> None:
    config = bench.Config(quick().preset, (CPU, CPU), hf=False)
    captured, graphed = (bench.CAPTURED, None, None), (bench.GRAPHED, "1f1b", 2)
    times = {(bench.SINGLE, None, None): 0.4, (bench.NAIVE, None, None): 0.8,
             captured: 0.2, ("mpstream", "1f1b", 2): 0.5, graphed: 0.25}  # fmt: skip
    measured = {k: bench.Measured(k, [t, t], [0.01]) for k, t in times.items()}
    results = bench.Results(config, measured, {"load": {}})
    rows = {row["configuration"]: row for row in report.to_json(results)["rows"]}
    row = rows[bench.label(graphed)]
    assert (row["vs_single_device"], row["vs_captured_single_device"]) == (0.625, 1.25)
    assert rows[bench.label(("mpstream", "1f1b", 2))]["vs_captured_single_device"] is None
    assert rows[bench.label(captured)]["vs_single_device"] == 0.5
    assert rows[bench.label(captured)]["vs_captured_single_device"] is None
    lines = report.table(results).splitlines()
    assert [ln for ln in lines if ln.startswith(bench.label(graphed))][0].split()[-4] == "1.25"
    assert any(ln.startswith(f"x single of {bench.GRAPHED}") for ln in lines)
    # The captured single device's own x single: against the eager one.
    assert [ln for ln in lines if ln.startswith(bench.label(captured))][0].split()[-4] == "0.50"
    del measured[captured]  # did not fit: graphed rows have no like-with-like ratio
    results = bench.Results(config, measured, {"load": {}}, {captured: "does not fit"})
    row = {r["configuration"]: r for r in report.to_json(results)["rows"]}[bench.label(graphed)]
    assert row["vs_captured_single_device"] is None and row["vs_single_device"] == 0.625
    assert not any(ln.startswith("x single of") for ln in report.table(results).splitlines())


def test_memory_of_a_step_captured_whole_is_its_graph_pool() -> None:
    p = transformer.preset("tiny")
    model, opt, step = trained(p)
    (stage,), _ = memory.per_stage(model, opt, step, [CPU], graph_bytes=12345)
    assert stage["activations"] == 12345
    naive = transformer.NaiveParallel(model, transformer.halves(p), [CPU, CPU])
    with pytest.raises(ValueError, match="graph_bytes is one stage's, but the module has 2"):
        memory.per_stage(naive, opt, step, [CPU], graph_bytes=1)


def test_a_captured_single_device_that_ran_eagerly_is_no_graphed_baseline() -> None:
    config = bench.Config(quick().preset, (CPU, CPU), hf=False)
    captured, graphed = (bench.CAPTURED, None, None), (bench.GRAPHED, "1f1b", 2)
    times = {(bench.SINGLE, None, None): 0.4, captured: 0.4, graphed: 0.25}
    measured = {k: bench.Measured(k, [t, t], [0.01]) for k, t in times.items()}
    measured[captured].eager = "its capture failed (operation not permitted)"
    rows = {
        row["configuration"]: row
        for row in report.to_json(bench.Results(config, measured, {"load": {}}))["rows"]
    }
    # Its times are an eager step's: graphed against it is not like with like.
    assert rows[bench.label(graphed)]["vs_captured_single_device"] is None
    assert rows[bench.label(graphed)]["vs_single_device"] == 0.625
    assert rows[bench.label(captured)]["vs_captured_single_device"] is None
    assert rows[bench.label(captured)]["ran_eagerly"] == measured[captured].eager

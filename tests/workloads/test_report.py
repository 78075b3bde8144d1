"""Tests of :mod:`mpstream.workloads.report`: a transformer bench's results as figures and text."""

from __future__ import annotations

import pytest
import torch

from mpstream.workloads import bench, report, transformer


def quick() -> bench.Config:
    p = transformer.preset("tiny", repeat=1, warmup=1, micro_batches=(2,))
    return bench.Config(p, (torch.device("cpu"),) * 2, hf=False)


def test_a_noisy_configuration_is_marked_with_what_to_do() -> None:
    config = quick()
    steady = [0.10, 0.11, 0.10]
    measured = {
        (bench.SINGLE, None, None): bench.Measured((bench.SINGLE, None, None), steady, []),
        (bench.NAIVE, None, None): bench.Measured((bench.NAIVE, None, None), steady, []),
        ("mpstream", "1f1b", 2): bench.Measured(("mpstream", "1f1b", 2), [0.1, 0.9, 0.1], []),
        ("mpstream", "gpipe", 2): bench.Measured(("mpstream", "gpipe", 2), steady, []),
    }
    results = bench.Results(config, measured, {"load": {}})
    rows = {row["configuration"]: row for row in report.to_json(results)["rows"]}
    noisy = bench.label(("mpstream", "1f1b", 2))
    assert rows[noisy]["ratio_noisy"] and rows[noisy]["step_s"]["spread"]["high"] == 0.9
    assert not rows[bench.label(("mpstream", "gpipe", 2))]["ratio_noisy"]
    assert report.to_json(results)["noisy"] == [noisy]
    text = report.table(results).splitlines()
    row = next(line for line in text if line.startswith(noisy))
    assert row.count("*") == 2  # both its ratios
    assert text[-1].startswith("* 1 measurement(s) noisy") and noisy in text[-1]


def test_the_table_says_which_way_its_ratios_go() -> None:
    # mpstream bench's ResNet table gives speed-ups (above 1: faster); this
    # one ratios of step times: 0.84 there and here mean opposite things.
    key = (bench.SINGLE, None, None)
    results = bench.Results(quick(), {key: bench.Measured(key, [0.1, 0.1], [])}, {"load": {}})
    text = report.table(results)
    assert "x single, x naive: its time over the single device's" in text
    assert "(below 1: faster)" in text


def test_mfu_is_against_the_peaks_of_the_devices_a_configuration_uses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Mixed devices: a pipeline over an H100 and an A100 has their two
    # peaks summed, not twice the first's; the single device has its own.
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA A100-SXM4-80GB"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names[device.index])
    p = transformer.preset("tiny", repeat=1, warmup=1, micro_batches=(2,))
    gpus = (torch.device("cuda", 0), torch.device("cuda", 1))
    config = bench.Config(p, gpus, hf=False)
    assert bench.peaks(config) == {"cuda:0": 989.4, "cuda:1": 312.0}
    single, pipeline = (bench.SINGLE, None, None), ("mpstream", "1f1b", 2)
    measured = {key: bench.Measured(key, [0.5], []) for key in (single, pipeline)}
    results = bench.Results(config, measured, {"load": {}, "peak_tflops": bench.peaks(config)})
    flop_per_s = transformer.flops_per_token(p) * p.tokens / 0.5
    assert report.mfu(results, single) == pytest.approx(flop_per_s / 989.4e12)
    assert report.mfu(results, pipeline) == pytest.approx(flop_per_s / (989.4e12 + 312.0e12))
    assert "(cuda:0 989.4, cuda:1 312.0 TFLOP/s)" in report.table(results)
    # Both halves on one device: it is counted once; an unknown one: no MFU.
    one = bench.Config(p, (gpus[0], gpus[0]), hf=False)
    results = bench.Results(one, measured, {"load": {}, "peak_tflops": bench.peaks(one)})
    assert report.mfu(results, pipeline) == pytest.approx(flop_per_s / 989.4e12)
    names[1] = "Some Other GPU"
    results = bench.Results(config, measured, {"load": {}, "peak_tflops": bench.peaks(config)})
    assert report.mfu(results, pipeline) is None
    assert report.mfu(results, single) is not None
    given = bench.Config(p, gpus, hf=False, peak=100.0)  # --peak-tflops: every device's
    assert bench.peaks(given) == {"cuda:0": 100.0, "cuda:1": 100.0}

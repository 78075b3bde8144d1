"""Tests of :mod:`mpstream.workloads.report`: a transformer bench's results as figures and text."""

from __future__ import annotations

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

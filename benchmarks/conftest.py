"""Shared setup of the benchmark suite: devices and sizes.

Two GPUs: the tutorial's ``cuda:0``/``cuda:1``; one GPU: both halves on
``cuda:0``; no GPU: the CPU at a reduced size. ``MPSTREAM_BENCH_DEVICES``
(``cuda:0,cuda:1``) overrides the detection.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from mpstream.tutorial import bench

ON_GPU = torch.cuda.is_available()

# Group "tutorial": the tutorial's sizes on a GPU; on the CPU the quick size,
# so the four models take about a minute including warm-up.
TUTORIAL = bench.FULL if ON_GPU else dataclasses.replace(bench.QUICK, repeat=3)
# Group "split_size": the tutorial's sweep needs 60 images per batch so that
# every split size differs; on the CPU one smaller-image batch of 60.
SWEEP = (
    bench.FULL
    if ON_GPU
    else dataclasses.replace(bench.QUICK, num_batches=1, batch_size=60, repeat=2)
)
SPLIT_SIZES = bench.FULL.split_sizes


@pytest.fixture(scope="session")
def devices() -> tuple[torch.device, torch.device]:
    return bench.detect_devices(os.environ.get("MPSTREAM_BENCH_DEVICES"))

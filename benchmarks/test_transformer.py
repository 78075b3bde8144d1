"""Group ``transformer``: one training step of the transformer workload per
way to train it, each with AdamW: the single device, naive model parallel
and mpstream's schedules over two micro-batch counts (``mpstream bench
--model transformer`` compares them side by side, with tokens/s, MFU and
memory per stage). The CPU's tiny preset; on a GPU the 1B-class one, in
bf16 under autocast. Untimed in CI, like the rest of the suite.
"""

from __future__ import annotations

from typing import Any

import pytest

from mpstream.workloads import bench, transformer

from .conftest import ON_GPU, suite_devices

PRESET = transformer.preset("1b" if ON_GPU else "tiny")
# The other groups' devices (MPSTREAM_BENCH_DEVICES), which the run records.
DEVICES = suite_devices()
CONFIG = bench.Config(PRESET, DEVICES, hf=False)
KEYS = [k for k in bench.keys_for(CONFIG) if k[2] in (None, *PRESET.micro_batches[:2])]


@pytest.mark.benchmark(group="transformer")
@pytest.mark.parametrize("key", KEYS, ids=bench.label)
def test_transformer_step(benchmark: Any, key: bench.Key) -> None:
    runner = bench._Runner(key, CONFIG)
    benchmark.extra_info.update(
        configuration=bench.label(key), tokens=PRESET.tokens, devices=[str(d) for d in DEVICES]
    )
    benchmark.pedantic(runner.timed, rounds=PRESET.repeat, warmup_rounds=PRESET.warmup)
    if not benchmark.disabled:
        benchmark.extra_info["tokens_per_s"] = PRESET.tokens / benchmark.stats.stats.median

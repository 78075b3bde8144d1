"""Groups ``tutorial`` and ``split_size``: the tutorial's training experiment.

Each round is one synchronised call of the tutorial's ``train``; warm-up
rounds are excluded.
"""

from __future__ import annotations

import pytest
import torch

from mpstream.tutorial import bench

from .conftest import SPLIT_SIZES, SWEEP, TUTORIAL


def _time(
    benchmark: object,
    name: str,
    split: int,
    config: bench.Config,
    devices: tuple[torch.device, torch.device],
) -> None:
    dev0, dev1 = devices
    if name not in bench.models_for(dev0, dev1):
        pytest.skip(f"{name}: {bench.left_out(dev0, dev1)[name]}")
    torch.manual_seed(0)
    model = bench.make_model(name, dev0, dev1, config, split)
    benchmark.extra_info.update(  # type: ignore[attr-defined]
        model=name,
        split_size=split if name in bench.swept(bench.MODELS) else None,
        devices=[str(dev0), str(dev1)],
        config=str(config),
    )
    benchmark.pedantic(  # type: ignore[attr-defined]
        bench.train_once,
        args=(model, config, devices),
        rounds=config.repeat,
        warmup_rounds=config.warmup,
        iterations=1,
    )


@pytest.mark.benchmark(group="tutorial")
@pytest.mark.parametrize("name", bench.MODELS)
def test_tutorial(benchmark: object, name: str, devices: tuple[torch.device, torch.device]) -> None:
    _time(benchmark, name, TUTORIAL.split_size, TUTORIAL, devices)


@pytest.mark.benchmark(group="split_size")
@pytest.mark.parametrize("split", SPLIT_SIZES)
@pytest.mark.parametrize("name", bench.PIPELINES)
def test_split_size(
    benchmark: object, name: str, split: int, devices: tuple[torch.device, torch.device]
) -> None:
    _time(benchmark, name, split, SWEEP, devices)

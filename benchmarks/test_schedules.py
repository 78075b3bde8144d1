"""Group ``schedules``: every schedule on the same model, side by side.

``train_step`` of the tutorial's ResNet50 in four stages (its four-device
cut, ``[7, 4, 6, 6]``) for every built-in schedule, with the
memory of one step in ``extra_info`` (GPU: the allocator's peak per device;
CPU: the peak bytes each stage's forwards saved for backward). The suite's
two devices (``MPSTREAM_BENCH_DEVICES``, else detected) hold the stages
round-robin, as interleaved 1F1B wants; where both are one device it holds
them all, interleaved 1F1B then running two ranks of two stages.

``split_backward``: one stage's split backward (B, then W) against its plain
backward, alternating on the same machine; ``extra_info`` has both medians
and their ratio, which should stay near 1 (B + W is one backward's work).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.observe.compare import measure_memory, split_cost
from mpstream.schedules import placement_of
from mpstream.schedules.schedule import SCHEDULES
from mpstream.tutorial import resnet50_layers
from mpstream.tutorial.analysis import resnet_stages
from mpstream.tutorial.bench import synchronize

from .conftest import ON_GPU

STAGES, MICROS = 4, 8
SPLIT, IMAGE = (8, 128) if ON_GPU else (2, 64)
# The split is measured on the memory group's micro-batch (the tutorial's
# 12 images of 128x128 on a GPU).
SPLIT_B, IMAGE_B = (12, 128) if ON_GPU else (4, 64)


def _devices(devices: tuple[torch.device, torch.device]) -> list[torch.device]:
    """The stages' devices: the suite's two in turn, not GPUs of its own
    (``MPSTREAM_BENCH_DEVICES``, which the run records, decides them)."""
    return [devices[s % 2] for s in range(STAGES)]


@pytest.fixture(scope="module")
def setup(devices: tuple[torch.device, torch.device]) -> tuple[Pipe, Tensor, Tensor]:
    pipe, x, y = resnet_stages(STAGES, MICROS, SPLIT, IMAGE, devices[0])
    placed = _devices(devices)
    if placed != pipe.devices:
        torch.manual_seed(0)
        pipe = Pipe(resnet50_layers(), chunks=MICROS, balance=pipe.balance, devices=placed)
    return pipe, x, y


def _virtual(pipe: Pipe) -> int | None:
    return None if pipe.devices[0] != pipe.devices[1] else 2


def _step(pipe: Pipe, x: Tensor, y: Tensor) -> None:
    pipe.zero_grad(set_to_none=True)
    pipe.train_step(x, y, nn.functional.mse_loss)
    synchronize(pipe.devices)


@pytest.mark.benchmark(group="schedules")
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_step_and_memory(
    benchmark: object, schedule: str, setup: tuple[Pipe, Tensor, Tensor]
) -> None:
    pipe, x, y = setup
    virtual = _virtual(pipe)
    kind = placement_of(schedule)
    if kind == "v" and pipe.devices[0] != pipe.devices[-1]:
        pytest.skip(f"{schedule} needs stages 0 and 3 on one device (a V), not round-robin")
    memory = measure_memory(pipe, x, y, nn.functional.mse_loss, [schedule], virtual)[schedule]
    pipe.schedule = schedule
    pipe.virtual_stages = {"round_robin": virtual, "v": 2}.get(kind)
    benchmark.extra_info.update(  # type: ignore[attr-defined]
        schedule=schedule,
        devices=[str(d) for d in pipe.devices],
        balance=pipe.balance,
        micro_batches=MICROS,
        images=f"{SPLIT * MICROS} of {IMAGE}x{IMAGE}",
        peak_memory_bytes=memory,
    )
    benchmark.pedantic(_step, args=(pipe, x, y), rounds=3, warmup_rounds=1)  # type: ignore[attr-defined]


def _stages() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    """The models the split is measured on: the tutorial's two ResNet50
    halves and an MLP, each with its input shape."""
    layers = list(resnet50_layers())
    half = (SPLIT_B, 512, IMAGE_B // 8, IMAGE_B // 8)
    return {
        "resnet50_first_half": (nn.Sequential(*layers[:11]), (SPLIT_B, 3, IMAGE_B, IMAGE_B)),
        "resnet50_second_half": (nn.Sequential(*layers[11:]), half),
        "mlp": (
            nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.Tanh()) for _ in range(4)]),
            (64, 1024),
        ),
    }


@pytest.mark.benchmark(group="split_backward")
@pytest.mark.parametrize("model", ["resnet50_first_half", "resnet50_second_half", "mlp"])
def test_split_backward_costs_one_backward(
    benchmark: object, model: str, devices: tuple[torch.device, torch.device]
) -> None:
    torch.manual_seed(0)
    stage, shape = _stages()[model]
    stage = stage.to(devices[0])
    sample = torch.randn(*shape, device=devices[0])
    # Untimed runs (--benchmark-disable) only check that it works.
    result = split_cost(stage, sample, repeat=1 if benchmark.disabled else 7)  # type: ignore[attr-defined]
    benchmark.extra_info.update(model=model, device=str(devices[0]), **result)  # type: ignore[attr-defined]
    benchmark.pedantic(split_cost, args=(stage, sample, 1), rounds=1)  # type: ignore[attr-defined]

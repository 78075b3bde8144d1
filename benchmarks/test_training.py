"""Groups ``memory``, ``balance`` and ``capture``: explicitly scheduled
training steps on the tutorial's ResNet50.

``memory``: step time of ``Pipe.train_step`` for gpipe vs 1f1b x every
checkpoint mode, with the peak memory in ``extra_info`` (GPU: the allocator's
peak per device; CPU: the peak bytes saved for backward, from
:class:`mpstream.memory.SavedTensorTracker`).

``balance``: the tutorial's split (layer2 | layer3) against the split
``balance_by_time`` picks on the same device.

``capture``: a training step with the optimizer, eager against a
:class:`mpstream.CapturedStep` replaying it as one CUDA graph, against
stages replayed from graphs, alone and captured with the zeroing and the
update per device (``CapturedStep`` over the graphed pipe), and against the
single device both ways (both stages on one GPU; skipped on the CPU, where
no graph exists and all would run eagerly).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor, nn

from mpstream import CapturedStep, Pipe
from mpstream.memory import SavedTensorTracker
from mpstream.stages.balance import balance_by_time, profile_layers
from mpstream.stages.partition import stage_costs
from mpstream.tutorial import bench, resnet50_layers
from mpstream.tutorial.analysis import batch
from mpstream.tutorial.bench import synchronize

from .conftest import ON_GPU

TUTORIAL_BALANCE = [11, 12]  # stem + layer1 + layer2 | layer3 + layer4 + head
BATCH, IMAGE, SPLIT = (120, 128, 12) if ON_GPU else (16, 64, 4)
CLASSES = 1000


def _data(device: torch.device) -> tuple[Tensor, Tensor]:
    config = dataclasses.replace(
        bench.QUICK, batch_size=BATCH, image_w=IMAGE, image_h=IMAGE, num_classes=CLASSES
    )
    return batch(config, device)


def _pipe(devices: tuple[torch.device, torch.device], balance: list[int], **kw: object) -> Pipe:
    torch.manual_seed(0)
    return Pipe(resnet50_layers(), split_size=SPLIT, balance=balance, devices=list(devices), **kw)  # type: ignore[arg-type]


def _step(pipe: Pipe, x: Tensor, y: Tensor) -> None:
    pipe.zero_grad(set_to_none=True)
    pipe.train_step(x, y, nn.MSELoss())
    synchronize(pipe.devices)


def _peak_memory(pipe: Pipe, x: Tensor, y: Tensor) -> dict[str, int]:
    """Peak memory of one step (after a warm-up step)."""
    _step(pipe, x, y)
    if ON_GPU:
        for d in set(pipe.devices):
            torch.cuda.reset_peak_memory_stats(d)
        _step(pipe, x, y)
        return {
            f"max_memory_allocated[{d}]": torch.cuda.max_memory_allocated(d)
            for d in set(pipe.devices)
        }
    with SavedTensorTracker() as tracker:
        _step(pipe, x, y)
    return {"peak_saved_activation_bytes": tracker.peak_bytes}


@pytest.mark.benchmark(group="memory")
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_train_step_memory(
    benchmark: object, schedule: str, checkpoint: str, devices: tuple[torch.device, torch.device]
) -> None:
    pipe = _pipe(devices, TUTORIAL_BALANCE, schedule=schedule, checkpoint=checkpoint)
    x, y = _data(devices[0])
    info = benchmark.extra_info  # type: ignore[attr-defined]
    info.update(
        schedule=schedule, checkpoint=checkpoint, batch=BATCH, image=IMAGE, split_size=SPLIT
    )
    info.update(_peak_memory(pipe, x, y))
    benchmark.pedantic(_step, args=(pipe, x, y), rounds=3, warmup_rounds=1)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def balanced(devices: tuple[torch.device, torch.device]) -> tuple[list[int], list[float]]:
    """The time-balanced split and the per-layer times it came from."""
    sample = torch.randn(SPLIT, 3, IMAGE, IMAGE)
    layers = resnet50_layers()
    times = [p.time_ms for p in profile_layers(layers, sample, device=devices[0], repeat=3)]
    return balance_by_time(layers, sample, 2, device=devices[0]), times


@pytest.mark.benchmark(group="balance")
@pytest.mark.parametrize("split", ["tutorial", "balanced"])
def test_tutorial_vs_balanced_split(
    benchmark: object,
    split: str,
    balanced: tuple[list[int], list[float]],
    devices: tuple[torch.device, torch.device],
) -> None:
    balance = TUTORIAL_BALANCE if split == "tutorial" else balanced[0]
    stage_ms = stage_costs(balanced[1], balance)
    pipe = _pipe(devices, balance)
    x, y = _data(devices[0])
    benchmark.extra_info.update(  # type: ignore[attr-defined]
        balance=balance, stage_ms=stage_ms, stage_share=[t / sum(stage_ms) for t in stage_ms]
    )
    benchmark.pedantic(_step, args=(pipe, x, y), rounds=3, warmup_rounds=1)  # type: ignore[attr-defined]


@pytest.mark.benchmark(group="capture")
@pytest.mark.parametrize(
    "mode",
    [
        "eager",
        "captured",
        "graphed stages",
        "captured over graphed stages",
        "single device eager",
        "single device captured",
    ],
)
def test_captured_vs_eager_step(
    benchmark: object, mode: str, devices: tuple[torch.device, torch.device]
) -> None:
    """A training step with SGD: eager, the whole step captured
    as one graph (CapturedStep), each stage replayed from graphs
    (Pipe(graphs=True)), those graphs with the zeroing and the update
    captured per device (CapturedStep over the graphed pipe: how a step
    across GPUs is captured), and the single device both ways, the
    like-with-like baseline of a graph."""
    graphed = {
        "captured": bench.GRAPHED,
        "graphed stages": bench.STAGE_GRAPHS,
        "captured over graphed stages": bench.STAGE_GRAPHS,
        "single device captured": bench.SINGLE_GRAPHED,
    }
    needs = graphed.get(mode)
    if needs is not None and needs not in bench.models_for(*devices):
        pytest.skip(f"{mode}: {bench.left_out(*devices)[needs]}")
    if mode.startswith("single device"):
        torch.manual_seed(0)
        layers = resnet50_layers()
        pipe = Pipe(layers, chunks=1, balance=[len(layers)], devices=[devices[0]])
    else:
        pipe = _pipe(devices, TUTORIAL_BALANCE, graphs=mode.endswith("graphed stages"))
    x, y = _data(devices[0])
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.MSELoss()
    captured = None
    if "captured" in mode:
        captured = CapturedStep(pipe, x, y, loss_fn, optimizer=optimizer)

    def step() -> None:
        if captured is not None:
            captured(x, y)
        else:
            optimizer.zero_grad(set_to_none=False)
            pipe.train_step(x, y, loss_fn)
            optimizer.step()
        synchronize(pipe.devices)

    benchmark.extra_info.update(  # type: ignore[attr-defined]
        mode=mode,
        batch=BATCH,
        image=IMAGE,
        split_size=SPLIT,
        launches=None if captured is None else captured.launches,
    )
    benchmark.pedantic(step, rounds=5, warmup_rounds=1)  # type: ignore[attr-defined]

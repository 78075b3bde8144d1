"""Streams really overlap: calibrated GPU sleeps take the time of a pipeline,
not of a serial run, forward and backward, copies and transfers included.

Marked ``cuda``: skipped cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from tests.cuda.helpers import (
    Sleep,
    SleepStage,
    cycles_per_ms,
    time_ms,
    two_gpus,
)

pytestmark = pytest.mark.cuda


def test_two_stages_on_one_gpu_overlap() -> None:
    stage_ms, micros = 5.0, 8
    cycles = int(cycles_per_ms() * stage_ms)
    stages = nn.Sequential(Sleep(cycles), Sleep(cycles))
    # The stages have no parameters: place them explicitly.
    pipe = Pipe(stages, chunks=micros, devices=["cuda:0", "cuda:0"])
    x = torch.zeros(micros, 1, device="cuda:0")

    def serial() -> None:
        for part in x.chunk(micros):
            stages(part)

    pipelined_ms = time_ms(lambda: pipe(x))
    serial_ms = time_ms(serial)
    ideal_ms = (micros + 1) * stage_ms
    assert serial_ms > 0.9 * 2 * micros * stage_ms, "calibration off: the serial run is too fast"
    # Ideal overlap is (micros + 1) / (2 micros) = 0.56 of the serial time.
    assert pipelined_ms < 0.75 * serial_ms, (pipelined_ms, serial_ms, ideal_ms)
    assert pipelined_ms > 0.9 * ideal_ms


@two_gpus
def test_copy_overlaps_compute_across_gpus() -> None:
    stage_ms, micros = 4.0, 8
    cycles = int(cycles_per_ms() * stage_ms)

    class Emit(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            torch.cuda._sleep(cycles)
            return x.repeat(1, 1 << 22)  # 16 MiB of float32 per micro-batch to copy

    class Take(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            torch.cuda._sleep(cycles)
            return x[:, :1] + 1

    pipe = Pipe(
        nn.Sequential(Emit(), Take()), balance=[1, 1], devices=["cuda:0", "cuda:1"], chunks=micros
    )
    x = torch.zeros(micros, 1, device="cuda:0")
    assert time_ms(lambda: pipe(x)) < 0.75 * 2 * micros * stage_ms


@pytest.mark.parametrize("how", ["forward+backward", "train_step"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_backward_overlaps_too(how: str, schedule: str) -> None:
    stage_ms, micros = 2.0, 8
    cycles = int(cycles_per_ms() * stage_ms)
    pipe = Pipe(
        nn.Sequential(SleepStage(cycles, cycles), SleepStage(cycles, cycles)),
        chunks=micros, devices=["cuda:0", "cuda:0"], schedule=schedule,
    )  # fmt: skip
    x, y = torch.zeros(micros, 4, device="cuda"), torch.zeros(micros, 4, device="cuda")

    def step() -> None:
        if how == "train_step":
            pipe.train_step(x, y, nn.MSELoss())
        else:
            pipe(x).sum().backward()

    measured = time_ms(step)
    serial = 2 * micros * 2 * stage_ms  # every forward and backward one after another
    ideal = 2 * (micros + 1) * stage_ms  # two stages overlapping, fill and drain
    assert measured < 0.75 * serial, (measured, serial, ideal)
    assert measured > 0.9 * ideal, (measured, ideal)


def test_host_to_device_copies_overlap_compute() -> None:
    """Pinned input moves on the io stream while the stage computes."""
    stage_ms, micros = 2.0, 8
    cycles = int(cycles_per_ms() * stage_ms)
    probe = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
    gbps = probe.numel() / time_ms(lambda: probe.to("cuda", non_blocking=True)) / 1e6
    rows = int(gbps * 1e6 * stage_ms / (4 * 1024))  # one micro-batch copies for ~stage_ms
    x = torch.zeros(micros * rows, 1024).pin_memory()
    copy_ms = time_ms(lambda: x[:rows].to("cuda", non_blocking=True))

    class Stage(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            torch.cuda._sleep(cycles)
            return x[:1]

    pipe = Pipe(nn.Sequential(Stage()), chunks=micros, devices=["cuda:0"])
    measured = time_ms(lambda: pipe(x))
    serial = micros * (copy_ms + stage_ms)
    overlapped = copy_ms + micros * max(copy_ms, stage_ms)
    assert overlapped < 0.7 * serial, "calibration: copies too short to tell"
    assert measured < (overlapped + serial) / 2, (measured, overlapped, serial)


def test_device_copies_overlap_compute_on_one_gpu() -> None:
    """With force_copies, device-to-device copies between two stages on one
    GPU run on the copy streams while both stages compute."""
    stage_ms, micros = 1.5, 8
    cycles = int(cycles_per_ms() * stage_ms)
    probe = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    gbps = probe.numel() / time_ms(lambda: probe.clone()) / 1e6
    big = torch.ones(int(gbps * 1e6 * stage_ms) // 4, device="cuda")  # ~stage_ms to copy
    copy_ms = time_ms(lambda: big.clone())

    class Emit(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            torch.cuda._sleep(cycles)
            return big.view(1, -1).expand(x.shape[0], -1)[:1]

    class Take(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            torch.cuda._sleep(cycles)
            return x[:, :1] + 1

    pipe = Pipe(
        nn.Sequential(Emit(), Take()), chunks=micros, devices=["cuda:0"] * 2, force_copies=True
    )
    x = torch.zeros(micros, 1, device="cuda")
    measured = time_ms(lambda: pipe(x))
    # Copies serialised with stage 0's compute vs on a stream of their own.
    serialised = micros * (stage_ms + copy_ms) + stage_ms
    overlapped = micros * max(stage_ms, copy_ms) + stage_ms + copy_ms
    assert overlapped < 0.75 * serialised, "calibration: copies too short to tell"
    assert measured < (overlapped + serialised) / 2, (measured, overlapped, serialised)

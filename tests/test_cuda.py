"""CUDA behaviour: results equal the CPU's, streams really overlap, the event
ordering is race-free under PyTorch's CUDA sanitizer, memory does not grow.

Every test here is marked ``cuda`` and skipped cleanly without a GPU.
"""

from __future__ import annotations

import copy
import os
import statistics
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from tests.helpers import mlp

pytestmark = pytest.mark.cuda

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)

BATCH = 12


def run_and_compare(model: nn.Sequential, pipe: Pipe, x: Tensor) -> None:
    """Forward + backward on the pipe (input on ``x``'s device) and on the CPU model."""
    x_ref = x.detach().cpu().clone().requires_grad_()
    x_pipe = x.detach().clone()
    if x.is_pinned():
        x_pipe = x_pipe.pin_memory()  # clone() does not keep pinning
    x_pipe.requires_grad_()
    out = pipe(x_pipe)
    ref = model(x_ref)
    assert out.device == pipe.devices[-1]
    torch.testing.assert_close(out.cpu(), ref)
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    torch.testing.assert_close(x_pipe.grad.cpu(), x_ref.grad)
    for (name, a), b in zip(pipe.named_parameters(), model.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, msg=name)


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("split_size", [1, 3, 7, BATCH, 20])
def test_stages_on_one_gpu_match_cpu(stages: int, split_size: int) -> None:
    model = mlp([5, 8, 7, 6, 4])
    balance = {2: [4, 4], 3: [3, 3, 2], 4: [2, 2, 2, 2]}[stages]
    pipe = Pipe(
        copy.deepcopy(model), split_size=split_size, balance=balance, devices=["cuda:0"] * stages
    )
    run_and_compare(model, pipe, torch.randn(BATCH, 5, dtype=torch.float64, device="cuda:0"))


@pytest.mark.parametrize("pinned", [False, True])
def test_cpu_input_is_copied_on_the_copy_stream(pinned: bool) -> None:
    model = mlp([5, 8, 4])
    pipe = Pipe(copy.deepcopy(model), chunks=3, balance=[2, 2], devices=["cuda:0", "cuda:0"])
    x = torch.randn(BATCH, 5, dtype=torch.float64)
    run_and_compare(model, pipe, x.pin_memory() if pinned else x)


@two_gpus
@pytest.mark.parametrize("split_size", [1, 5, BATCH])
def test_two_gpus_match_cpu(split_size: int) -> None:
    model = mlp([5, 8, 7, 4])
    pipe = Pipe(
        copy.deepcopy(model), split_size=split_size, balance=[3, 3], devices=["cuda:0", "cuda:1"]
    )
    run_and_compare(model, pipe, torch.randn(BATCH, 5, dtype=torch.float64, device="cuda:0"))


@two_gpus
def test_tutorial_resnet50_on_two_gpus_matches_cpu() -> None:
    from mpstream.tutorial import StreamPipelineResNet50

    gpu = StreamPipelineResNet50("cuda:0", "cuda:1", split_size=3, num_classes=10).double().eval()
    cpu = StreamPipelineResNet50("cpu", "cpu", split_size=3, num_classes=10).double().eval()
    cpu.load_state_dict(gpu.state_dict())
    x = torch.randn(8, 3, 64, 64, dtype=torch.float64)
    torch.testing.assert_close(gpu(x.cuda()).cpu(), cpu(x))


def test_tutorial_resnet50_on_one_gpu_matches_cpu() -> None:
    from mpstream.tutorial import StreamPipelineResNet50

    gpu = StreamPipelineResNet50("cuda:0", "cuda:0", split_size=3, num_classes=10).double()
    cpu = StreamPipelineResNet50("cpu", "cpu", split_size=3, num_classes=10).double()
    cpu.load_state_dict(gpu.state_dict())
    x = torch.randn(8, 3, 64, 64, dtype=torch.float64)
    out_gpu, out_cpu = gpu(x.cuda()), cpu(x)
    torch.testing.assert_close(out_gpu.cpu(), out_cpu)
    out_gpu.sum().backward()
    out_cpu.sum().backward()
    grads = dict(cpu.named_parameters())
    for name, p in gpu.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), grads[name].grad, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("devices", [["cuda:0"] * 3, "two"])
def test_train_step_on_gpus_matches_cpu(schedule: str, checkpoint: str, devices: object) -> None:
    if devices == "two":
        if torch.cuda.device_count() < 2:
            pytest.skip("needs two CUDA devices")
        devices = ["cuda:0", "cuda:1", "cuda:1"]
    model = mlp([5, 8, 7, 4])
    ref = copy.deepcopy(model)
    pipe = Pipe(
        copy.deepcopy(model),
        split_size=3,
        balance=[2, 2, 2],
        devices=devices,
        schedule=schedule,
        checkpoint=checkpoint,
    )  # type: ignore[arg-type]
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 4, dtype=torch.float64)
    loss = pipe.train_step(x.pin_memory(), y, nn.MSELoss())
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach())
    for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, msg=name)


@two_gpus
def test_stage_code_runs_with_its_device_current() -> None:
    seen: list[tuple[int, int, int]] = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: Tensor) -> Tensor:
            seen.append(
                (
                    x.device.index,
                    torch.cuda.current_device(),
                    torch.cuda.current_stream().device.index,
                )
            )
            return self.lin(x) + torch.ones(1, device="cuda")  # the current device's

    pipe = Pipe(
        nn.Sequential(Probe(), Probe()), balance=[1, 1], devices=["cuda:0", "cuda:1"], chunks=2
    )
    pipe(torch.ones(4, 2, device="cuda:0")).sum().backward()
    assert seen and all(d == current == stream for d, current, stream in seen)
    assert torch.cuda.current_device() == 0


class Sleep(nn.Module):
    """Spins the current stream for ``cycles`` GPU clock cycles."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.cycles = cycles

    def forward(self, x: Tensor) -> Tensor:
        torch.cuda._sleep(self.cycles)
        return x + 1


def cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    samples = []
    for _ in range(5):
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        samples.append(10_000_000 / start.elapsed_time(end))
    return statistics.median(samples)


def time_ms(fn: object, repeat: int = 5) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()  # type: ignore[operator]
    samples = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start.record()
        fn()  # type: ignore[operator]
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


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


def test_streams_are_restored_after_a_failure() -> None:
    class Fail(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            raise RuntimeError("boom")

    pipe = Pipe(nn.Sequential(nn.Linear(2, 2).cuda(), Fail()), chunks=2)
    before = torch.cuda.current_stream()
    with pytest.raises(RuntimeError, match="boom"):
        pipe(torch.ones(4, 2, device="cuda"))
    assert torch.cuda.current_stream() == before
    assert pipe.scheduler.events_free == pipe.scheduler.events_created


def test_stages_run_on_their_own_streams() -> None:
    seen: list[tuple[int, int]] = []

    class Spy(nn.Module):
        def __init__(self, stage: int) -> None:
            super().__init__()
            self.stage = stage
            self.lin = nn.Linear(2, 2)

        def forward(self, x: Tensor) -> Tensor:
            seen.append((self.stage, torch.cuda.current_stream().stream_id))
            return self.lin(x)

    pipe = Pipe(nn.Sequential(Spy(0), Spy(1)).cuda(), chunks=3)
    pipe(torch.ones(6, 2, device="cuda"))
    streams = pipe.scheduler.compute_streams
    assert all(sid == streams[s].stream_id for s, sid in seen)
    assert streams[0] != streams[1] != torch.cuda.default_stream()


def test_timing_events_cover_every_task() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).cuda(), chunks=4)
    sched = pipe.scheduler
    sched.timing = True
    pipe(torch.randn(8, 8, device="cuda"))
    timings = sched.timings()
    sched.timing = False
    assert {(t.stage, t.micro) for t in timings} == {(s, m) for s in range(2) for m in range(4)}
    assert all(t.end_ms >= t.start_ms >= 0 for t in timings)


def test_memory_does_not_grow_across_steps() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(3)]).cuda()
    pipe = Pipe(model, split_size=4, balance=[1, 1, 1], devices=["cuda:0"] * 3)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    x = torch.randn(32, 256, device="cuda")

    def step() -> None:
        opt.zero_grad()
        pipe(x).pow(2).mean().backward()
        opt.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for _ in range(50):
        step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= baseline


SANITIZED = textwrap.dedent(
    """
    import torch
    from torch import nn
    import mpstream
    from mpstream import Pipe
    from mpstream.tutorial import StreamPipelineResNet50

    torch.manual_seed(0)
    devices = {devices}
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in devices])
    pipe = Pipe(model, split_size=3, balance=[1] * len(devices), devices=devices)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        pipe(torch.randn(10, 64, device=devices[0])).pow(2).mean().backward()
        opt.step()
    net = StreamPipelineResNet50(devices[0], devices[-1], split_size=4, num_classes=10)
    net(torch.randn(8, 3, 64, 64, device=devices[0])).sum().backward()
    for schedule, checkpoint in (("gpipe", "never"), ("1f1b", "except_last")):
        stepper = Pipe(nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64))
                                       for _ in devices]),
                       split_size=4, balance=[1] * len(devices), devices=devices,
                       schedule=schedule, checkpoint=checkpoint, deferred_batch_norm=True)
        for _ in range(2):
            stepper.train_step(torch.randn(12, 64).pin_memory(), torch.randn(12, 64),
                               nn.MSELoss())
    with mpstream.profile(pipe) as prof:
        pipe(torch.randn(10, 64, device=devices[0])).sum().backward()
    assert prof.spans
    torch.cuda.synchronize()
    print("sanitized run finished")
    """
)


def sanitized(devices: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    return subprocess.run(
        [sys.executable, "-c", SANITIZED.format(devices=devices)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cuda:0"] * 3])
def test_cuda_sanitizer_reports_no_race_on_one_gpu(devices: list[str]) -> None:
    result = sanitized(devices)
    assert "CSAN detected" not in result.stderr, result.stderr[-4000:]
    assert result.returncode == 0, result.stderr[-4000:]
    assert "sanitized run finished" in result.stdout


@two_gpus
def test_cuda_sanitizer_reports_no_race_across_gpus() -> None:
    result = sanitized(["cuda:0", "cuda:1"])
    assert "CSAN detected" not in result.stderr, result.stderr[-4000:]
    assert result.returncode == 0, result.stderr[-4000:]

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
import time

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


@pytest.mark.parametrize("force_copies", [False, True])
@pytest.mark.parametrize("pinned", [False, True])
def test_cpu_input_and_its_gradient_match_cpu(pinned: bool, force_copies: bool) -> None:
    model = mlp([5, 8, 4])
    pipe = Pipe(
        copy.deepcopy(model),
        chunks=3,
        balance=[2, 2],
        devices=["cuda:0", "cuda:0"],
        force_copies=force_copies,
    )
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
@pytest.mark.parametrize("devices", ["one", "forced", "two"])
def test_train_step_on_gpus_matches_cpu(schedule: str, checkpoint: str, devices: str) -> None:
    if devices == "two" and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    layout = ["cuda:0", "cuda:1", "cuda:1"] if devices == "two" else ["cuda:0"] * 3
    model = mlp([5, 8, 7, 4])
    ref = copy.deepcopy(model)
    pipe = Pipe(
        copy.deepcopy(model),
        split_size=3,
        balance=[2, 2, 2],
        devices=layout,
        schedule=schedule,
        checkpoint=checkpoint,
        force_copies=devices == "forced",
    )
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 4, dtype=torch.float64)
    # Pinned input, pageable targets: both move in transfer tasks.
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
    # Compute outranks copies: a same-GPU copy kernel must not hold the SMs.
    copies = pipe.scheduler.copy_streams
    assert all(s.priority < c.priority for s, c in zip(streams, copies))


def test_timing_events_cover_every_task() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).cuda(), chunks=4)
    sched = pipe.scheduler
    sched.timing = True
    pipe(torch.randn(8, 8, device="cuda"))
    timings = sched.timings()
    sched.timing = False
    assert {(t.stage, t.micro) for t in timings} == {(s, m) for s in range(2) for m in range(4)}
    assert all(t.end_ms >= t.start_ms >= 0 for t in timings)
    assert all(t.issue_ms > 0 for t in timings)


def test_issue_times_measure_the_host_not_the_device() -> None:
    class Slow(nn.Module):
        """Issues one kernel after 20 ms of host work."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.02)
            return x + 1

    pipe = Pipe(
        nn.Sequential(Slow(), nn.Identity()), chunks=2, balance=[1, 1], devices=["cuda:0"] * 2
    )
    sched = pipe.scheduler
    sched.timing = True
    pipe(torch.randn(8, 8, device="cuda"))
    timings = sched.timings()
    sched.timing = False
    slow = [t for t in timings if t.stage == 0]
    assert len(slow) == 2 and all(t.issue_ms >= 19 for t in slow)
    assert all(t.issue_ms < 10 for t in timings if t.stage == 1)


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
    from mpstream.doctor.sanitizer import csan_workarounds
    from mpstream.tutorial import StreamPipelineResNet50

    def run():
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
        for schedule, checkpoint in (("gpipe", "never"), ("1f1b", "except_last"),
                                     ("zb_h1", "never"), ("interleaved_1f1b", "except_last")):
            virtual = len(devices) if len(set(devices)) == 1 else None
            for force in (False, True):
                stepper = Pipe(nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64))
                                               for _ in devices]),
                               split_size=4, balance=[1] * len(devices), devices=devices,
                               schedule=schedule, checkpoint=checkpoint, deferred_batch_norm=True,
                               force_copies=force,
                               virtual_stages=virtual if schedule == "interleaved_1f1b" else None)
                for _ in range(2):
                    stepper.train_step(torch.randn(12, 64).pin_memory(), torch.randn(12, 64),
                                       nn.MSELoss())
                x = torch.randn(12, 64, requires_grad=True)  # pageable, needs its gradient
                stepper(x).sum().backward()
                assert x.grad is not None
        mixed = Pipe(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), split_size=3,
                     balance=[1, 1], devices=["cpu", devices[-1]])
        mixed(torch.randn(10, 64, requires_grad=True)).sum().backward()
        mixed.train_step(torch.randn(10, 64), torch.randn(10, 64), nn.MSELoss())
        with mpstream.profile(pipe) as prof:
            pipe(torch.randn(10, 64, device=devices[0])).sum().backward()
        assert prof.spans
        torch.cuda.synchronize()

    with csan_workarounds():  # see its docstring: two CSAN flaws, not races
        run()
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


# -- the hot path: no host synchronization, transfers on the io stream -------------


def norm_mlp() -> nn.Sequential:
    """Linear layers with BatchNorms, one of them a cumulative average."""
    return nn.Sequential(
        nn.Linear(16, 32), nn.BatchNorm1d(32, momentum=None), nn.Tanh(),
        nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 8),
    )  # fmt: skip


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pinned", [True, False])
def test_no_host_synchronization_in_a_step(schedule: str, pinned: bool) -> None:
    """Forward, backward and train_step never make the host wait for the
    device: CUDA's sync debug mode raises on any synchronizing call."""
    pipe = Pipe(
        norm_mlp().cuda(),
        split_size=4,
        balance=[3, 3, 1],
        devices=["cuda:0"] * 3,
        schedule=schedule,
        checkpoint="except_last",
        deferred_batch_norm=True,
        force_copies=True,
    )
    x, y = torch.randn(16, 16), torch.randn(16, 8)
    if pinned:
        x, y = x.pin_memory(), y.pin_memory()

    def step() -> None:
        pipe(x).pow(2).mean().backward()
        pipe.train_step(x, y, nn.MSELoss())

    step()  # warm-up: allocator, cuBLAS handles, pinned blocks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _stream_spy(monkeypatch: pytest.MonkeyPatch, module: str, name: str) -> list[int]:
    """Records the current stream's id whenever ``module.name`` is called."""
    import importlib

    target = importlib.import_module(module)
    real = getattr(target, name)
    seen: list[int] = []

    def spy(x: Tensor, device: torch.device, *args: object, **kwargs: object) -> Tensor:
        where = device if device.type == "cuda" else x.device
        seen.append(torch.cuda.current_stream(where).stream_id)
        return real(x, device, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(target, name, spy)
    return seen


def test_inputs_and_targets_move_on_the_io_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = Pipe(mlp([5, 8, 4]).float().cuda(), chunks=3, balance=[2, 2], devices=["cuda:0"] * 2)
    io = pipe.scheduler.io_streams[0].stream_id  # type: ignore[union-attr]
    in_forward = _stream_spy(monkeypatch, "mpstream.runtime.copy", "to_device")
    in_train = _stream_spy(monkeypatch, "mpstream.runtime.training", "to_device")
    x, y = torch.randn(BATCH, 5), torch.randn(BATCH, 4)
    pipe(x).sum().backward()
    pipe.train_step(x.pin_memory(), y, nn.MSELoss())
    assert in_forward == [io] * 3
    assert in_train == [io] * 6  # 3 inputs, 3 targets
    sched = pipe.scheduler
    sched.timing = True
    pipe.train_step(x, y, nn.MSELoss())
    spans = sched.timings()
    sched.timing = False
    transfers = [t for t in spans if (t.kind, t.stage) == ("copy", -1) or t.kind == "target"]
    assert len(transfers) == 6 and {t.stream for t in transfers} == {"io@cuda:0"}


def test_forced_copies_run_on_the_sending_copy_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = Pipe(
        mlp([5, 8, 7, 4]).float().cuda(), chunks=2, balance=[2, 2, 2], devices=["cuda:0"] * 3,
        force_copies=True,
    )  # fmt: skip
    copies = [st.stream_id for st in pipe.scheduler.copy_streams]  # type: ignore[union-attr]
    seen = _stream_spy(monkeypatch, "mpstream.runtime.copy", "move")
    x = torch.randn(BATCH, 5, device="cuda")
    out = pipe(x)
    assert seen == [copies[0], copies[0], copies[1], copies[1]]  # stage 0 -> 1, then 1 -> 2
    seen.clear()
    out.sum().backward()
    # Gradients go back on the stream of each forward copy's autograd node,
    # which autograd made wait for the incoming gradient.
    assert sorted(seen) == sorted([copies[0], copies[0], copies[1], copies[1]])


# -- overlap that fails when streams serialise ----------------------------------------


class SleepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: Tensor, forward: int, backward: int) -> Tensor:  # type: ignore[override]
        torch.cuda._sleep(forward)
        ctx.backward = backward  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        torch.cuda._sleep(ctx.backward)  # type: ignore[attr-defined]
        return grad.clone(), None, None


class SleepStage(nn.Module):
    """``forward`` and ``backward`` cycles of GPU sleep per micro-batch."""

    def __init__(self, forward: int, backward: int) -> None:
        super().__init__()
        self.cycles = (forward, backward)
        self.w = nn.Parameter(torch.ones(1, device="cuda"))

    def forward(self, x: Tensor) -> Tensor:
        return SleepFn.apply(x * self.w, *self.cycles)  # type: ignore[no-any-return]


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


# -- the allocator: freed blocks are not reused while another stream reads ------------


@pytest.mark.parametrize("force_copies", [False, True])
@pytest.mark.parametrize("how", ["forward+backward", "train_step"])
def test_allocator_reuse_keeps_results_exact(force_copies: bool, how: str) -> None:
    """Stage 0 is fast and scribbles over fresh memory; stage 1 sleeps before
    it reads its input. A tensor freed by the host while another stream
    still has to read it, without record_stream, would be handed to stage 0's
    next allocation and overwritten: the results would differ."""
    cycles = int(cycles_per_ms() * 2.0)

    class Scribble(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64).double()

        def forward(self, x: Tensor) -> Tensor:
            junk = torch.full((x.shape[0], 64), float("nan"), dtype=x.dtype, device=x.device)
            del junk
            return self.lin(x) * 2 + 1

    class Late(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 8).double()

        def forward(self, x: Tensor) -> Tensor:
            torch.cuda._sleep(cycles)
            return self.lin(x)

    model = nn.Sequential(Scribble(), Late())
    ref = copy.deepcopy(model)
    pipe = Pipe(
        model.cuda(), split_size=2, devices=["cuda:0", "cuda:0"], force_copies=force_copies
    )
    x, y = torch.randn(16, 64, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)
    for _ in range(3):
        pipe.zero_grad()
        ref.zero_grad()
        if how == "train_step":
            loss = pipe.train_step(x, y, nn.MSELoss())
            expected = nn.MSELoss()(ref(x), y)
            expected.backward()
            torch.testing.assert_close(loss.cpu(), expected.detach())
        else:
            out = pipe(x.cuda())
            expected = ref(x)
            torch.testing.assert_close(out.cpu(), expected)
            out.pow(2).sum().backward()
            expected.pow(2).sum().backward()
        for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad.cpu(), b.grad, msg=name)


# -- failures, timing, stream pool ----------------------------------------------------


def test_a_failed_step_restores_state_after_its_queued_kernels() -> None:
    """loss_fn fails after the last stage's kernels were queued: the restore
    (on the caller's stream) is ordered after them, and the next step works."""
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 8)).cuda()
    pipe = Pipe(model, split_size=4, balance=[2, 1], devices=["cuda:0"] * 2, schedule="1f1b")
    x, y = torch.randn(16, 64, device="cuda"), torch.randn(16, 8, device="cuda")
    pipe.train_step(x, y, nn.MSELoss())
    grads = [p.grad.clone() for p in pipe.parameters()]  # type: ignore[union-attr]
    stats = [b.clone() for b in pipe.buffers()]
    with pytest.raises(TypeError, match="scalar"):
        pipe.train_step(x, y, nn.MSELoss(reduction="none"))
    for p, g in zip(pipe.parameters(), grads):
        torch.testing.assert_close(p.grad, g)
    for b, saved in zip(pipe.buffers(), stats):
        torch.testing.assert_close(b, saved)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    pipe.train_step(x, y, nn.MSELoss())


def test_timing_events_are_pooled() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).cuda(), chunks=4)
    sched = pipe.scheduler
    sched.timing = True
    x = torch.randn(8, 8, device="cuda")
    for _ in range(30):
        pipe(x)
        torch.cuda.synchronize()
    assert len(sched.timings()) == 30 * 8
    sched.timing = False
    # Two events per task of one run (and the run in flight), not per run.
    assert sched.timing_events_created <= 2 * 2 * 8


def test_too_many_stages_on_one_gpu_warn_about_shared_streams() -> None:
    from mpstream.runtime.scheduler import StreamAliasWarning

    # PyTorch pools 32 streams per priority and device; compute streams
    # have a pool of their own (high priority), so 40 stages must share.
    layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(40)]).cuda()
    pipe = Pipe(layers, balance=[1] * 40, devices=["cuda:0"] * 40)
    with pytest.warns(StreamAliasWarning, match="stage0.compute@cuda:0 = "):
        assert pipe.scheduler is not None


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_cpu_stage_then_cuda_stage_matches_cpu(schedule: str) -> None:
    """A CPU stage feeding a GPU stage: its pageable output moves through a
    pinned buffer; the gradient comes back with a blocking copy."""
    model = mlp([5, 8, 7, 4])
    ref = copy.deepcopy(model)
    pipe = Pipe(
        copy.deepcopy(model), split_size=3, balance=[2, 4], devices=["cpu", "cuda:0"],
        schedule=schedule,
    )  # fmt: skip
    run_and_compare(model, pipe, torch.randn(BATCH, 5, dtype=torch.float64))
    pipe.zero_grad()
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 4, dtype=torch.float64)
    loss = pipe.train_step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach())
    for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, msg=name)


def test_pageable_input_reuses_pinned_buffers_across_steps() -> None:
    """One pinned buffer per tensor per step, recycled by PyTorch's caching
    host allocator: no new cudaHostAlloc in the steady state."""
    pipe = Pipe(mlp([64, 64, 8]).float().cuda(), split_size=4, balance=[2, 2],
                devices=["cuda:0"] * 2)  # fmt: skip
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    for _ in range(3):
        pipe.train_step(x, y, nn.MSELoss())
        torch.cuda.synchronize()
    before = torch.cuda.host_memory_stats()["num_host_alloc"]
    for _ in range(10):
        pipe.train_step(x, y, nn.MSELoss())
        pipe(x).sum().backward()
        torch.cuda.synchronize()
    assert torch.cuda.host_memory_stats()["num_host_alloc"] == before


# -- models as users train them: tied weights, amp, compile, errors (issue 12) -----


def test_tied_weights_on_one_gpu_match_cpu() -> None:
    model = mlp([5, 5, 5, 5])
    model[4].weight = model[0].weight  # stages 0 and 2 share it, both on cuda:0
    ref = copy.deepcopy(model)
    pipe = Pipe(copy.deepcopy(model).cuda(), split_size=3, balance=[2, 2, 2],
                devices=["cuda:0"] * 3, schedule="1f1b", checkpoint="except_last")  # fmt: skip
    run_and_compare(ref, pipe, torch.randn(BATCH, 5, dtype=torch.float64, device="cuda:0"))
    pipe.zero_grad()
    ref.zero_grad()
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 5, dtype=torch.float64)
    pipe.train_step(x, y, nn.MSELoss())
    nn.MSELoss()(ref(x), y).backward()
    for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, msg=name)


@two_gpus
def test_tied_weights_across_gpus_are_rejected() -> None:
    model = mlp([5, 5, 5])
    model[2].weight = model[0].weight
    with pytest.raises(ValueError, match=r"'0\.weight' \(stage 0, cuda:0\) is shared with "
                                         r"'2\.weight' \(stage 1, cuda:1\)"):  # fmt: skip
        Pipe(model, balance=[2, 2], devices=["cuda:0", "cuda:1"])


def test_a_gpu_that_does_not_exist_fails_at_construction() -> None:
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=rf"stage 1 is on {missing}, but only "
                                         r".*available devices: cpu, cuda:0"):  # fmt: skip
        Pipe(mlp([4, 4, 4]), balance=[2, 2], devices=["cuda:0", missing])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_autocast_on_gpus_equals_the_unsplit_model(dtype: torch.dtype, checkpoint: str) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(),
                        nn.Linear(32, 8)).cuda()  # fmt: skip
    pipe = Pipe(copy.deepcopy(ref), split_size=4, balance=[2, 3], devices=["cuda:0"] * 2,
                checkpoint=checkpoint, force_copies=True)  # fmt: skip
    x = torch.randn(BATCH, 16, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        out = pipe(x)
        expected = torch.cat([ref(part) for part in x.split(4)])
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected)
    out.float().pow(2).sum().backward()
    expected.float().pow(2).sum().backward()
    for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_grad_scaler_with_fp16_autocast_train_step(schedule: str) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).cuda()
    pipe = Pipe(copy.deepcopy(ref), split_size=4, balance=[2, 1], devices=["cuda:0"] * 2,
                schedule=schedule, checkpoint="except_last")  # fmt: skip
    scalers = [torch.amp.GradScaler("cuda") for _ in range(2)]
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pipe, ref)]
    for _ in range(3):
        x, y = torch.randn(BATCH, 16, device="cuda"), torch.randn(BATCH, 8, device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = pipe.train_step(x, y, nn.MSELoss(), scaler=scalers[0])
            expected = torch.zeros((), device="cuda")
            for xp, yp in zip(x.split(4), y.split(4)):
                part = nn.MSELoss()(ref(xp), yp) * (len(xp) / BATCH)
                scalers[1].scale(part).backward()
                expected += part.detach()
        torch.testing.assert_close(loss, expected)
        for scaler, opt in zip(scalers, optims):
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, msg=name)


def test_compiled_stages_on_a_gpu_equal_the_eager_pipe() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(inplace=True),
                          nn.Linear(32, 8)).cuda()  # fmt: skip
    kwargs = {"split_size": 4, "balance": [2, 2], "devices": ["cuda:0"] * 2,
              "checkpoint": "except_last", "schedule": "1f1b"}  # fmt: skip
    eager = Pipe(copy.deepcopy(model), **kwargs)  # type: ignore[arg-type]
    compiled = Pipe(model, compile={"backend": "aot_eager"}, **kwargs)  # type: ignore[arg-type]
    x, y = torch.randn(BATCH, 16, device="cuda"), torch.randn(BATCH, 8, device="cuda")
    for pipe in (eager, compiled):
        pipe(x).pow(2).sum().backward()
        pipe.train_step(x, y, nn.MSELoss())
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.mark.parametrize("how", ["forward+backward", "train_step"])
def test_in_place_first_op_with_checkpointing_on_a_gpu(how: str) -> None:
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(inplace=True), nn.Linear(8, 4)).double()
    ref = copy.deepcopy(model)
    pipe = Pipe(copy.deepcopy(model).cuda(), split_size=3, balance=[1, 2],
                devices=["cuda:0"] * 2, checkpoint="always")  # fmt: skip
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 4, dtype=torch.float64)
    if how == "train_step":
        pipe.train_step(x, y, nn.MSELoss())
    else:
        nn.MSELoss()(pipe(x.cuda()), y.cuda()).backward()
    nn.MSELoss()(ref(x), y).backward()
    for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, msg=name)


# -- schedules: interleaved 1F1B, zero-bubble H1, user-given orders -------------


# zb_h1's order for 4 stages and 4 micro-batches, every weight pass moved last.
def _user_order() -> str:
    from mpstream.schedules.schedule import Schedule

    order = str(Schedule("zb_h1", 4, 4, [False] * 4)).split()
    return " ".join([a for a in order if a[0] != "W"] + [a for a in order if a[0] == "W"])


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zb_h1", "custom"])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("devices", ["one", "forced", "round-robin"])
def test_schedules_on_gpus_match_cpu(schedule: str, checkpoint: str, devices: str) -> None:
    if devices == "round-robin" and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    layout = ["cuda:0", "cuda:1"] * 2 if devices == "round-robin" else ["cuda:0"] * 4
    model = mlp([5, 8, 7, 6, 4])
    ref = copy.deepcopy(model)
    pipe = Pipe(
        copy.deepcopy(model),
        split_size=3,
        balance=[2, 2, 2, 2],
        devices=layout,
        schedule=_user_order() if schedule == "custom" else schedule,
        checkpoint=checkpoint,
        force_copies=devices == "forced",
        virtual_stages=2 if schedule == "interleaved_1f1b" and devices != "round-robin" else None,
    )
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 4, dtype=torch.float64)
    loss = pipe.train_step(x.pin_memory(), y, nn.MSELoss())
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach())
    for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, msg=name)


class _FailThird(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("third micro-batch failed")
        return x


def test_deferred_statistics_survive_a_failed_forward_on_a_gpu() -> None:
    """Stage 1 fails at micro-batch 2, after stage 0's norm may have seen
    every micro-batch: nothing of the failed batch reaches the statistics."""

    def build(failing: bool) -> Pipe:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4),
                              _FailThird() if failing else nn.Identity()).cuda()  # fmt: skip
        return Pipe(model, chunks=4, balance=[2, 2], devices=["cuda:0"] * 2,
                    deferred_batch_norm=True)  # fmt: skip

    pipe, ref = build(True), build(False)
    with pytest.raises(RuntimeError, match="third micro-batch failed"):
        pipe(torch.randn(16, 8, device="cuda"))
    for _ in range(2):
        x = torch.randn(16, 8, device="cuda")
        pipe(x)
        ref(x)
    for (name, a), b in zip(pipe.named_buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zb_h1"])
def test_no_host_synchronization_in_new_schedules(schedule: str) -> None:
    pipe = Pipe(
        norm_mlp().cuda(),
        split_size=4,
        balance=[3, 3, 1],
        devices=["cuda:0"] * 3,
        schedule=schedule,
        virtual_stages=3 if schedule == "interleaved_1f1b" else None,
        deferred_batch_norm=True,
        force_copies=True,
    )
    x, y = torch.randn(16, 16).pin_memory(), torch.randn(16, 8).pin_memory()
    pipe.train_step(x, y, nn.MSELoss())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pipe.train_step(x, y, nn.MSELoss())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_peak_memory_per_device_by_schedule() -> None:
    """max_memory_allocated per device for each schedule on the same model:
    the schedules that bound live activations use less than fill-drain."""
    from mpstream.observe.compare import measure_memory

    devices = ["cuda:0", "cuda:1"] * 2 if torch.cuda.device_count() > 1 else ["cuda:0"] * 4
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(8)])
    pipe = Pipe(model, chunks=8, balance=[2, 2, 2, 2], devices=devices)
    x, y = torch.randn(256, 512), torch.randn(256, 512)
    virtual = None if devices[0] != devices[1] else 2
    peaks = measure_memory(pipe, x, y, nn.functional.mse_loss, virtual_stages=virtual)
    gpipe = sum(peaks["gpipe"].values())
    for name in ("1f1b", "interleaved_1f1b", "zb_h1"):
        assert sum(peaks[name].values()) < gpipe, peaks

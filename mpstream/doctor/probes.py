"""Doctor step 3: overlap, measured on work of known length.

Each probe pipelines stages whose work is a calibrated ``torch.cuda._sleep``
(forward and backward) and copies sized to take as long as a stage, times
each part alone and the whole pipelined, and is judged by
:mod:`mpstream.doctor.overlap`: compute ∥ compute (two stages on one GPU, forward
and ``train_step`` per schedule), copy ∥ compute device→device (copies
forced on one GPU; peer copies across two GPUs when present; forward and
``train_step``), and copy ∥ compute from pinned host memory on the io
stream. The probes also run on the CPU, where host sleeps stand in for the
GPU's and nothing overlaps.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..observe.cost_model import simulate
from ..observe.profiling import profile
from ..pipe import Pipe
from ..runtime import synchronize
from .diagnosis import FAIL, Context, StepResult, overall
from .overlap import FLOOR, TARGET, Overlap, size_copy

__all__ = [
    "Busy",
    "spinner",
    "task_ms",
    "per_call_ms",
    "compute_probes",
    "copy_probes",
    "host_probe",
    "run",
]

COPY_MICROS = 4  # copy probes allocate every micro-batch's buffers at once


class _Spin(torch.autograd.Function):
    """Occupies the current stream for a set time in forward and in backward.

    Outputs are allocated but never written: no kernel besides the sleep, so
    the only memory traffic of a probe is its copies.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor, spin: Callable[[], None], width: int
    ) -> Tensor:
        ctx.spin = spin
        ctx.shape = x.shape
        spin()
        return x.new_empty((x.shape[0], width))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        ctx.spin()
        gx = grad.new_empty(ctx.shape) if ctx.needs_input_grad[0] else None
        gw = grad.new_zeros(()) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None


class Busy(nn.Module):
    """A stage that spins ``spin`` in forward and backward and outputs ``width`` columns."""

    def __init__(self, spin: Callable[[], None], width: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))
        self.spin = spin
        self.width = width

    def forward(self, x: Tensor) -> Tensor:
        return _Spin.apply(x, self.weight, self.spin, self.width)  # type: ignore[no-any-return]


@functools.cache
def cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles ``torch.cuda._sleep`` spins per millisecond on ``device``."""
    with torch.cuda.device(device):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda._sleep(1_000_000)  # type: ignore[no-untyped-call]  # warm-up
        samples: list[float] = []
        for _ in range(5):
            start.record()
            torch.cuda._sleep(10_000_000)  # type: ignore[no-untyped-call]
            end.record()
            end.synchronize()
            samples.append(10_000_000 / float(start.elapsed_time(end)))
    return statistics.median(samples)


def spinner(device: torch.device, ms: float) -> Callable[[], None]:
    """Work of ``ms`` milliseconds on ``device``'s current stream (a host sleep on the CPU)."""
    if device.type == "cuda":
        cycles = int(cycles_per_ms(device) * ms)
        return lambda: torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
    return lambda: time.sleep(ms / 1e3)


def task_ms(spin: Callable[[], None], device: torch.device) -> float:
    """Milliseconds ``spin`` takes on ``device`` (made current: a sleep runs on the current one)."""
    if device.type != "cuda":
        return per_call_ms(spin, [device])
    with torch.cuda.device(device):
        return per_call_ms(spin, [device])


def per_call_ms(fn: Callable[[], object], devices: Sequence[torch.device], calls: int = 8) -> float:
    """Milliseconds per call of ``fn`` issued back to back (median of 3 batches)."""
    fn()
    samples = []
    for _ in range(3):
        synchronize(devices)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(devices)
        samples.append((time.perf_counter() - start) * 1e3 / calls)
    return statistics.median(samples)


def _median_ms(
    fn: Callable[[], object], devices: Sequence[torch.device], repeat: int, warmup: int = 2
) -> float:
    samples = []
    for i in range(warmup + repeat):
        synchronize(devices)
        start = time.perf_counter()
        fn()
        synchronize(devices)
        if i >= warmup:
            samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _copy_ms(nbytes: int, src: torch.device, dst: torch.device) -> float:
    """Milliseconds to copy ``nbytes`` from ``src`` (pinned if the host) to ``dst``."""
    if src.type == "cpu" and dst.type == "cuda":
        data = torch.empty(nbytes // 4, pin_memory=True)
        return per_call_ms(lambda: data.to(dst, non_blocking=True), [dst], calls=4)
    data = torch.empty(nbytes // 4, device=src)
    return per_call_ms(lambda: data.to(dst, copy=True), [src, dst], calls=4)


def _forward(pipe: Pipe, x: Tensor) -> Callable[[], object]:
    def run() -> object:
        with torch.no_grad():
            return pipe(x)

    return run


def _train(pipe: Pipe, x: Tensor, y: Tensor) -> Callable[[], object]:
    def step() -> object:
        pipe.zero_grad(set_to_none=True)
        return pipe.train_step(x, y, nn.MSELoss())

    return step


def compute_probes(
    device: torch.device, stage_ms: float, micros: int, repeat: int
) -> list[Overlap]:
    """compute ∥ compute: two sleeping stages on one device, forward and both schedules."""
    spin = spinner(device, stage_ms)
    t = task_ms(spin, device)
    x = torch.zeros(micros, 1, device=device)
    y = torch.zeros(micros, 1, device=device)
    out = []
    for schedule in ("forward", "gpipe", "1f1b"):
        pipe = Pipe(
            nn.Sequential(Busy(spin), Busy(spin)),
            chunks=micros,
            balance=[1, 1],
            devices=[device, device],
            schedule="gpipe" if schedule == "forward" else schedule,
        )
        if schedule == "forward":
            measured = _median_ms(_forward(pipe, x), [device], repeat)
            costs: list[Any] = [t, t]
        else:
            measured = _median_ms(_train(pipe, x, y), [device], repeat)
            costs = [(t, t), (t, t)]
        backward = schedule != "forward"
        ideal = simulate(costs, 0.0, micros, "1f1b" if schedule == "1f1b" else "gpipe").step_ms
        serial = micros * t * (4 if backward else 2)
        name = f"compute ∥ compute on {device}, " + (
            "forward" if not backward else f"train_step {schedule}"
        )
        out.append(Overlap(name, measured, serial, ideal, serial, {"task_ms": t}))
    return out


def copy_probes(
    dev0: torch.device,
    dev1: torch.device,
    stage_ms: float,
    repeat: int,
    cap_bytes: int,
    gantt: Callable[[Pipe, Callable[[], object]], None] | None = None,
) -> list[Overlap]:
    """copy ∥ compute between two stages: device→device copies on the copy streams.

    On one device the copies are forced (``force_copies=True``); across two
    they are peer copies. Forward and a ``train_step`` (gradient copies back).
    ``gantt(pipe, step)``, if given, is called to draw the training step.
    """
    devices = [dev0, dev1]
    same = dev0 == dev1
    probe = min(64 * 2**20, cap_bytes)
    bandwidth = probe / _copy_ms(probe, dev0, dev1)
    size, stage = size_copy(bandwidth, stage_ms, cap_bytes)
    width = size // 4
    c = _copy_ms(size, dev0, dev1)
    spins = [spinner(dev0, stage), spinner(dev1, stage)]
    t = statistics.fmean(task_ms(s, d) for s, d in zip(spins, devices))
    micros = COPY_MICROS
    x = torch.zeros(micros, 1, device=dev0)
    y = torch.zeros(micros, 1, device=dev1)
    labels = ["stage0", "stage1"]  # distinct: the model places a copy between them
    kind = "forced device→device copies" if same else "peer copies"
    where = f"{dev0}" if same else f"{dev0} → {dev1}"
    info = {"copy_bytes": size, "copy_ms": c, "task_ms": t, "bandwidth_gbps": bandwidth / 1e6}
    out = []
    for backward in (False, True):
        pipe = Pipe(
            nn.Sequential(Busy(spins[0], width), Busy(spins[1])),
            chunks=micros,
            balance=[1, 1],
            devices=devices,
            force_copies=same,
        )
        stages: list[Any] = [(t, t), (t, t)] if backward else [t, t]
        copies: Any = (c, c) if backward else c
        if backward:
            step = _train(pipe, x, y)
            measured = _median_ms(step, devices, repeat)
            if gantt is not None:
                gantt(pipe, step)
        else:
            measured = _median_ms(_forward(pipe, x), devices, repeat)
        ideal = simulate(stages, copies, micros, backward=backward, devices=labels).step_ms
        blocked = simulate(
            stages, copies, micros, overlap=False, backward=backward, devices=labels
        ).step_ms
        serial = micros * ((4 * t + 2 * c) if backward else (2 * t + c))
        name = f"copy ∥ compute, {kind} on {where}, " + ("train_step" if backward else "forward")
        out.append(Overlap(name, measured, serial, ideal, blocked, dict(info)))
        del pipe
    return out


def host_probe(device: torch.device, stage_ms: float, repeat: int, cap_bytes: int) -> Overlap:
    """copy ∥ compute from the host: a pinned batch moved on the io stream while
    the stage sleeps on its compute stream."""
    cpu = torch.device("cpu")
    probe = min(64 * 2**20, cap_bytes)
    bandwidth = probe / _copy_ms(probe, cpu, device)
    size, stage = size_copy(bandwidth, stage_ms, cap_bytes)
    c = _copy_ms(size, cpu, device)
    micros = COPY_MICROS
    x = torch.empty(micros, size // 4, pin_memory=True)
    spin = spinner(device, stage)
    t = task_ms(spin, device)
    pipe = Pipe(nn.Sequential(Busy(spin)), chunks=micros, balance=[1], devices=[device])
    measured = _median_ms(_forward(pipe, x), [device], repeat)
    # The transfer is a stage of its own: micro-batch m's copy overlaps m-1's compute.
    ideal = simulate([c, t], 0.0, micros).step_ms
    serial = micros * (c + t)
    info = {"copy_bytes": size, "copy_ms": c, "task_ms": t, "bandwidth_gbps": bandwidth / 1e6}
    name = f"copy ∥ compute, host→{device} from pinned memory (io stream), forward"
    return Overlap(name, measured, serial, ideal, serial, info)


def run(ctx: Context) -> StepResult:
    """Runs every probe that applies to the devices (the step needs CUDA)."""
    dev0, dev1 = ctx.devices
    sizes = ctx.sizes
    free = min(torch.cuda.mem_get_info(d)[0] for d in {dev0, dev1})
    # Every micro-batch's buffers may be alive at once, twice over with gradients.
    cap = int(min(2**30, free / (8 * COPY_MICROS)))
    files: list[str] = []

    def gantt(pipe: Pipe, step: Callable[[], object]) -> None:
        with profile(pipe) as prof:
            step()
        synchronize([dev0, dev1])
        title = "overlap probe: train_step with copies as long as stages (numbers: micro-batches)"
        prof.plot(ctx.out / "overlap.png", title=title)
        prof.export_chrome_trace(ctx.scratch / "overlap_trace.json")
        files.extend(["overlap.png", "overlap_trace.json"])

    results: list[Overlap] = []
    with ctx.bar(4, "overlap probes") as bar:
        results += compute_probes(dev0, sizes.probe_ms, sizes.probe_micros, sizes.probe_repeat)
        bar.update(1)
        results += copy_probes(dev0, dev0, sizes.probe_ms, sizes.probe_repeat, cap, gantt)
        bar.update(1)
        if dev1 != dev0:
            results += copy_probes(dev0, dev1, sizes.probe_ms, sizes.probe_repeat, cap)
        bar.update(1)
        results.append(host_probe(dev0, sizes.probe_ms, sizes.probe_repeat, cap))
        bar.update(1)
    torch.cuda.empty_cache()  # the copy probes' buffers would skew the memory step
    checks = [r.check() for r in results]
    fractions = [r.fraction for r in results if r.fraction is not None]
    worst = min(fractions) if fractions else 0.0
    figure = f"overlap fraction min {worst:.2f} over {len(results)} probes (target {TARGET}, "
    figure += f"FAIL below {FLOOR})"
    status = overall(checks)
    reason = next((f"{c.name}: {c.detail}" for c in checks if c.status == FAIL), "")
    if not reason and worst < TARGET:
        reason = f"below the {TARGET} target in {sum(f < TARGET for f in fractions)} probe(s)"
    data = {"target": TARGET, "floor": FLOOR, "probes": [c.to_json() for c in checks]}
    return StepResult("overlap", "Overlap", status, figure, reason, checks, data, files)

"""Group ``overhead``: what the runtime itself costs on the host.

(a) Issue cost per task (one stage x one micro-batch) of mpstream's C++
    event scheduler against the same plan issued from Python, the stages
    on the suite's two devices in turn (as group ``schedules``): where they
    differ the plan's copies between stages are issued too.
(b) mpstream against a plain Python loop over the same stages and
    micro-batches, on the CPU: the ratio is the runtime's own cost.
The mpstream tests also time both alternately, round by round, and record
the median ratio (``extra_info['paired_ratio']``): on a shared VM whose
speed drifts, that ratio is steadier than two separately timed groups.
Graphed stages' host work is group ``graphed`` (test_graphed.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime.scheduler import EventScheduler
from mpstream.schedules.schedule import Schedule
from mpstream.tutorial import StreamPipelineResNet50

from .pyscheduler import PyEventScheduler

STAGES, MICROS = 4, 32


def _issue_devices(devices: tuple[torch.device, torch.device]) -> list[torch.device]:
    """The stages' devices: the suite's two in turn (separate streams on a
    GPU), as the run records them: ``MPSTREAM_BENCH_DEVICES`` decides them,
    not whether CUDA is there."""
    return [devices[s % 2] for s in range(STAGES)]


def _schedule(devices: list[torch.device]) -> Schedule:
    copy_in = [False] + [devices[s] != devices[s - 1] for s in range(1, STAGES)]
    return Schedule("gpipe", STAGES, MICROS, copy_in, backward=True)


def _run_cpp(sched: EventScheduler, schedule: Schedule) -> None:
    # As the run loop does: the C++ scheduler's methods, called directly.
    native = sched.native
    native.begin_run(schedule.native, sched.caller_streams())
    for task in schedule.tasks:
        native.end(native.begin(task.index))
    native.join()


@pytest.mark.benchmark(group="overhead")
def test_issue_cost_cpp(benchmark: object, devices: tuple[torch.device, torch.device]) -> None:
    stages = _issue_devices(devices)
    schedule, sched = _schedule(stages), EventScheduler(stages)
    benchmark.extra_info.update(tasks=len(schedule), devices=[str(d) for d in stages])  # type: ignore[attr-defined]
    benchmark.pedantic(_run_cpp, args=(sched, schedule), rounds=200, warmup_rounds=5)  # type: ignore[attr-defined]
    py = PyEventScheduler(stages)  # paired_ratio: C++ / Python, below 1 when C++ is cheaper
    _paired(benchmark, lambda: py.run(schedule), lambda: _run_cpp(sched, schedule), 200)


@pytest.mark.benchmark(group="overhead")
def test_issue_cost_python(benchmark: object, devices: tuple[torch.device, torch.device]) -> None:
    stages = _issue_devices(devices)
    schedule, sched = _schedule(stages), PyEventScheduler(stages)
    benchmark.extra_info.update(tasks=len(schedule), devices=[str(d) for d in stages])  # type: ignore[attr-defined]
    benchmark.pedantic(sched.run, args=(schedule,), rounds=200, warmup_rounds=5)  # type: ignore[attr-defined]


def _paired(
    benchmark: object, plain: Callable[[], None], mine: Callable[[], None], rounds: int
) -> None:
    """Records the median over ``rounds`` of mine / plain, timed back to back."""
    if benchmark.disabled:  # type: ignore[attr-defined]
        return  # the suite runs untimed in CI: skip the extra rounds
    ratios = []
    for _ in range(rounds):
        start = time.perf_counter()
        plain()
        middle = time.perf_counter()
        mine()
        ratios.append((time.perf_counter() - middle) / (middle - start))
    benchmark.extra_info.update(  # type: ignore[attr-defined]
        paired_ratio=statistics.median(ratios), paired_rounds=rounds
    )


def _loop_step(stages: list[nn.Module], x: Tensor, split: int) -> None:
    out = []
    for part in x.split(split):
        for stage in stages:
            part = stage(part)
        out.append(part)
    torch.cat(out).pow(2).mean().backward()


def _pipe_step(pipe: nn.Module, x: Tensor) -> None:
    pipe(x).pow(2).mean().backward()


def _tiny() -> tuple[nn.Sequential, Tensor, int]:
    stages = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(STAGES)])
    return stages, torch.randn(MICROS * 4, 64), 4


@pytest.mark.benchmark(group="overhead")
def test_cpu_tiny_plain_loop(benchmark: object) -> None:
    stages, x, split = _tiny()
    benchmark.extra_info.update(stages=STAGES, micro_batches=MICROS)  # type: ignore[attr-defined]
    benchmark.pedantic(_loop_step, args=(list(stages), x, split), rounds=30, warmup_rounds=3)  # type: ignore[attr-defined]


@pytest.mark.benchmark(group="overhead")
def test_cpu_tiny_mpstream(benchmark: object) -> None:
    stages, x, split = _tiny()
    pipe = Pipe(stages, split_size=split)
    benchmark.extra_info.update(stages=STAGES, micro_batches=MICROS)  # type: ignore[attr-defined]
    benchmark.pedantic(_pipe_step, args=(pipe, x), rounds=30, warmup_rounds=3)  # type: ignore[attr-defined]
    _paired(benchmark, lambda: _loop_step(list(stages), x, split), lambda: _pipe_step(pipe, x), 60)


def _resnet() -> tuple[StreamPipelineResNet50, Tensor, int]:
    torch.manual_seed(0)
    model = StreamPipelineResNet50("cpu", "cpu", split_size=4, num_classes=1000)
    return model, torch.randn(16, 3, 64, 64), 4


@pytest.mark.benchmark(group="overhead")
def test_cpu_resnet_plain_loop(benchmark: object) -> None:
    model, x, split = _resnet()
    benchmark.pedantic(
        _loop_step, args=([model.seq1, model.head], x, split), rounds=5, warmup_rounds=1
    )  # type: ignore[attr-defined]


@pytest.mark.benchmark(group="overhead")
def test_cpu_resnet_mpstream(benchmark: object) -> None:
    model, x, split = _resnet()
    benchmark.pedantic(_pipe_step, args=(model, x), rounds=5, warmup_rounds=1)  # type: ignore[attr-defined]
    plain = [model.seq1, model.head]
    _paired(benchmark, lambda: _loop_step(plain, x, split), lambda: _pipe_step(model, x), 8)


@pytest.mark.benchmark(group="overhead")
def test_captured_step_checks_per_call(benchmark: object) -> None:
    """What a CapturedStep checks before each replay (nothing replaced,
    moved or laid out anew, gradients and optimizer state the captured
    ones), for ResNet-101's 314 parameters with SGD's momentum: the host
    cost a one-graph step adds to its one launch."""
    import torchvision

    from mpstream.capture.state import Kept, Trained

    m = torchvision.models.resnet101()
    layers = nn.Sequential(
        m.conv1, m.bn1, m.relu, m.maxpool, m.layer1, m.layer2, m.layer3, m.layer4,
        m.avgpool, nn.Flatten(), m.fc,
    )  # fmt: skip
    pipe = Pipe(layers, balance=[5, 6], devices=["cpu", "cpu"], chunks=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for p in pipe.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    kept = Kept(Trained(pipe, nn.MSELoss(), opt), zeroing=True)
    benchmark(kept.check)  # type: ignore[operator]

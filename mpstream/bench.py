"""The tutorial's experiment, timed: single device vs the tutorial's models vs mpstream.

Each measurement is one call of the tutorial's ``train`` (``num_batches``
mini-batches of random images, MSELoss, SGD), with device work synchronised
inside the timed region and warm-up calls excluded, as in the tutorial's
``timeit.repeat(number=1)``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from . import tutorial

__all__ = ["Config", "Measurement", "QUICK", "FULL", "detect_devices", "time_train", "experiment"]


@dataclass(frozen=True)
class Config:
    """Sizes and repetitions of the experiment."""

    num_batches: int = 3
    batch_size: int = 120
    image_w: int = 128
    image_h: int = 128
    num_classes: int = tutorial.NUM_CLASSES
    repeat: int = 10
    warmup: int = 1
    split_size: int = 12
    split_sizes: tuple[int, ...] = (1, 3, 5, 8, 10, 12, 20, 40, 60)


FULL = Config()
# Sized so the whole quick run takes about a minute on two CPU cores.
QUICK = Config(
    num_batches=2,
    batch_size=16,
    image_w=64,
    image_h=64,
    repeat=3,
    warmup=1,
    split_size=4,
    split_sizes=(2, 4, 8, 16),
)


@dataclass
class Measurement:
    """Times of one model configuration, in seconds."""

    model: str
    split_size: int | None
    times: list[float] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times)

    @property
    def std(self) -> float:
        return statistics.pstdev(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def detect_devices(spec: str | None = None) -> tuple[torch.device, torch.device]:
    """The two devices of the experiment.

    Args:
        spec: ``"cuda:0,cuda:1"``-style; default two GPUs if present, else
            both halves on ``cuda:0``, else both on the CPU.

    Raises:
        ValueError: ``spec`` does not name exactly two valid devices.
    """
    if spec is not None:
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        if len(parts) != 2:
            raise ValueError(f"--devices needs two comma-separated devices, got {spec!r}")
        try:
            devs = [torch.device(p) for p in parts]
        except RuntimeError as exc:
            raise ValueError(f"--devices: {exc}") from None
        for d in devs:
            if d.type not in ("cpu", "cuda"):
                raise ValueError(f"--devices: {d} is not a cpu or cuda device")
            if d.type == "cuda":
                if not torch.cuda.is_available():
                    raise ValueError(f"--devices: {d} requested but CUDA is not available")
                if (d.index or 0) >= torch.cuda.device_count():
                    raise ValueError(
                        f"--devices: {d} does not exist ({torch.cuda.device_count()} GPU(s))"
                    )
        return devs[0], devs[1]
    if torch.cuda.is_available():
        second = 1 if torch.cuda.device_count() > 1 else 0
        return torch.device("cuda", 0), torch.device("cuda", second)
    return torch.device("cpu"), torch.device("cpu")


def _sync(devices: tuple[torch.device, ...]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def time_train(model: nn.Module, config: Config, devices: tuple[torch.device, ...]) -> list[float]:
    """Times ``config.repeat`` calls of the tutorial's train loop.

    Returns:
        Seconds per call, warm-up calls excluded.
    """
    times = []
    for i in range(config.warmup + config.repeat):
        _sync(devices)
        start = time.perf_counter()
        tutorial.train(
            model,
            num_batches=config.num_batches,
            batch_size=config.batch_size,
            image_w=config.image_w,
            image_h=config.image_h,
            num_classes=config.num_classes,
            input_device=devices[0],
        )
        _sync(devices)
        if i >= config.warmup:
            times.append(time.perf_counter() - start)
    return times


ModelFactory = Callable[[], nn.Module]


def factories(
    dev0: torch.device, dev1: torch.device, config: Config, split_size: int
) -> dict[str, tuple[ModelFactory, int | None]]:
    """The four models of the comparison, by display name."""
    n = config.num_classes
    return {
        "single device": (lambda: tutorial.single_device_resnet50(dev0, n), None),
        "model parallel": (lambda: tutorial.ModelParallelResNet50(dev0, dev1, n), None),
        "tutorial pipeline": (
            lambda: tutorial.PipelineParallelResNet50(dev0, dev1, split_size, n),
            split_size,
        ),
        "mpstream": (
            lambda: tutorial.StreamPipelineResNet50(dev0, dev1, split_size, n),
            split_size,
        ),
    }


def experiment(
    config: Config,
    dev0: torch.device,
    dev1: torch.device,
    *,
    progress: Callable[[str], None] | None = None,
) -> list[Measurement]:
    """Times the four models at ``config.split_size``.

    Returns:
        One measurement per model, in display order.
    """
    out = []
    for name, (make, split) in factories(dev0, dev1, config, config.split_size).items():
        if progress is not None:
            progress(name)
        torch.manual_seed(0)
        model = make()
        out.append(Measurement(name, split, time_train(model, config, (dev0, dev1))))
        del model
    return out


def table(results: list[Measurement], reference: str = "single device") -> str:
    """A text table: mean ± std per model and speed-up against ``reference``."""
    ref = next((r.mean for r in results if r.model == reference), None)
    lines = [
        f"{'model':<20} {'split':>5} {'mean ± std (s)':>18} {'median (s)':>11} {'speed-up':>9}"
    ]
    for r in results:
        split = "-" if r.split_size is None else str(r.split_size)
        speed = f"{ref / r.mean:8.2f}x" if ref else "-"
        lines.append(
            f"{r.model:<20} {split:>5} {r.mean:>9.3f} ± {r.std:<6.3f} {r.median:>11.3f} {speed:>9}"
        )
    return "\n".join(lines)

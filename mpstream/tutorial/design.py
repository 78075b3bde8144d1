"""What the tutorial's experiment measures and records: its models, its sizes, its measurements.

The models it compares by name (:data:`MODELS`) and which of them these
devices can run (:func:`models_for`, :func:`left_out`); its sizes
(:class:`Config`, the tutorial's :data:`FULL` and the CPU's :data:`QUICK`);
and what a run records (:class:`Measurement`, :class:`Results`). The
timing is :mod:`.bench`'s, the printing and saving :mod:`.report`'s.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..runtime import explicit_device
from . import models as tutorial
from . import rounds

__all__ = [
    "Config",
    "Measurement",
    "Results",
    "QUICK",
    "FULL",
    "MODELS",
    "PIPELINES",
    "GRAPHED",
    "STAGE_GRAPHS",
    "SINGLE_GRAPHED",
    "GRAPHS",
    "models_for",
    "left_out",
    "swept",
    "label",
]

GRAPHED = "mpstream, CUDA graph"
STAGE_GRAPHS = "mpstream, graphed stages"
SINGLE_GRAPHED = "single device, CUDA graph"
MODELS = (
    "single device",
    SINGLE_GRAPHED,
    "model parallel",
    "tutorial pipeline",
    "mpstream",
    STAGE_GRAPHS,
    GRAPHED,
)
PIPELINES = ("tutorial pipeline", "mpstream")
#: The models replaying CUDA graphs, and each one's baseline captured the
#: same way: a graphed pipeline is compared with the single device whose
#: whole step is one graph, not with an eager single device.
GRAPHS = {GRAPHED: SINGLE_GRAPHED, STAGE_GRAPHS: SINGLE_GRAPHED, SINGLE_GRAPHED: SINGLE_GRAPHED}


def models_for(dev0: torch.device, dev1: torch.device) -> tuple[str, ...]:
    """The models measurable on these devices (see :func:`left_out`)."""
    skipped = left_out(dev0, dev1)
    return tuple(m for m in MODELS if m not in skipped)


def left_out(dev0: torch.device, dev1: torch.device) -> dict[str, str]:
    """The models not measurable on these devices, each with why.

    No CUDA graph exists on a CPU: a graphed model would time its step
    eagerly and read as a slow "CUDA graph", so it is left out. A whole
    captured step (:data:`GRAPHED`) also needs both halves on one GPU; graphed
    stages (:data:`STAGE_GRAPHS`) need each half on a GPU.
    """
    out: dict[str, str] = {}
    if dev0.type != "cuda":
        out[SINGLE_GRAPHED] = f"no CUDA graph on {dev0.type}: its step would only run eagerly"
    for model in (STAGE_GRAPHS, GRAPHED):
        cpu = next((d for d in (dev0, dev1) if d.type != "cuda"), None)
        if cpu is not None:
            out[model] = f"no CUDA graph on {cpu.type}: its step would only run eagerly"
    if GRAPHED not in out and not _same(dev0, dev1):
        out[GRAPHED] = "a CUDA graph cannot span two devices"
    return out


def swept(models: Sequence[str]) -> tuple[str, ...]:
    """Those of ``models`` that take a split size: the split-size sweep's."""
    return tuple(m for m in models if m in PIPELINES or m in (STAGE_GRAPHS, GRAPHED))


def _same(a: torch.device, b: torch.device) -> bool:
    """Whether two device names mean one device (``cuda`` is the current one)."""
    return explicit_device(a) == explicit_device(b)


@dataclass(frozen=True)
class Config:
    """Sizes and repetitions of the experiment (defaults: the tutorial's;
    ``split_size``, the one the four models are timed at, its best, 12;
    ``split_sizes``, the sweep's, taken in increasing order, each once)."""

    num_batches: int = 3
    batch_size: int = 120
    image_w: int = 128
    image_h: int = 128
    num_classes: int = tutorial.NUM_CLASSES
    repeat: int = 10
    warmup: int = 1
    split_size: int = 12
    split_sizes: tuple[int, ...] = (1, 3, 5, 8, 10, 12, 20, 40, 60)
    arch: str = "resnet50"  # or "resnet101", IDRIS's variant (tutorial.ARCHS)

    def __post_init__(self) -> None:
        # The sweep's curve and table run in increasing order, one point per size.
        object.__setattr__(self, "split_sizes", tuple(sorted(set(self.split_sizes))))


FULL = Config()
# CPU-sized: the whole run (four models and the sweep) takes about a minute
# on two cores. Images stay 64x64 so layer4 keeps 2x2 activations and
# BatchNorm works down to a split size of 1.
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
    """Seconds per ``train`` call of one model configuration."""

    model: str
    split_size: int | None
    times: list[float] = field(default_factory=list)
    group: int | None = None  # run's: timed round-robin with the others of its group

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times)

    @property
    def std(self) -> float:
        return statistics.pstdev(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> rounds.Spread:
        """How its rounds vary, and whether they disagree (:attr:`~.rounds.Spread.noisy`)."""
        return rounds.spread(self.times)

    @property
    def noisy(self) -> bool:
        return self.spread.noisy

    def to_json(self) -> dict[str, Any]:
        out = {
            "model": self.model,
            "split_size": self.split_size,
            "times_s": self.times,
            "mean_s": self.mean,
            "std_s": self.std,
            "median_s": self.median,
            "spread": self.spread.to_json(),
        }
        return out if self.group is None else {**out, "group": self.group}


@dataclass
class Results:
    """Everything one ``mpstream bench`` run measured."""

    config: Config
    devices: tuple[torch.device, torch.device]
    models: list[Measurement]
    sweep: list[Measurement]
    #: The host's load when the run began and when it ended (:func:`.rounds.machine_load`).
    load: dict[str, dict[str, float | int | None]] = field(default_factory=dict)
    #: An interrupt ended the run early: ``models`` and ``sweep`` hold what
    #: was timed, and these configurations (by :func:`label`) were not.
    not_timed: list[str] | None = None

    @property
    def interrupted(self) -> bool:
        return self.not_timed is not None

    @property
    def noisy(self) -> list[Measurement]:
        """The configurations whose rounds disagree (each once)."""
        unique = {id(m): m for m in self.models + self.sweep}
        return [m for m in unique.values() if m.noisy]

    def get(self, model: str, split_size: int | None = None) -> Measurement:
        found = self.find(model, split_size)
        if found is None:
            raise KeyError((model, split_size))
        return found

    def find(self, model: str, split_size: int | None = None) -> Measurement | None:
        """:meth:`get`, or None where it was not timed (an interrupted run)."""
        for m in self.models + self.sweep:
            if m.model == model and (split_size is None or m.split_size == split_size):
                return m
        return None


def label(key: tuple[str, int | None]) -> str:
    """A configuration's name: the model, and its split size if it has one."""
    name, split = key
    return name if split is None else f"{name} (split {split})"

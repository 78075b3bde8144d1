"""The vocabulary of ``mpstream doctor``: statuses, checks, step results, sizes, context.

Every doctor step returns a :class:`StepResult` built from :class:`Check`
items, so whether a step passes is decided by plain functions over numbers
(testable without a GPU) and the runner, the console lines and the report
all read the same structure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..tutorial.bench import FULL as BENCH_FULL
from ..tutorial.bench import QUICK as BENCH_QUICK
from ..tutorial.bench import Config

__all__ = [
    "PASS",
    "FAIL",
    "SKIP",
    "INFO",
    "STATUSES",
    "Check",
    "StepResult",
    "Sizes",
    "FULL",
    "QUICK",
    "TINY",
    "Context",
    "overall",
    "jsonable",
]

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
STATUSES = (PASS, FAIL, SKIP)
# A check's figure with no verdict (a prediction); it does not decide its step.
INFO = "INFO"


@dataclass
class Check:
    """One verdict inside a step (a grid case, a probe, a sanitizer run).

    Attributes:
        name: what was checked.
        status: PASS, FAIL or SKIP; INFO for a figure that is no verdict.
        detail: the figure or the reason, one line.
        data: the measurements behind it (JSON-ready).
    """

    name: str
    status: str
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail, **self.data}


def overall(checks: Iterable[Check]) -> str:
    """A step's status from its checks: FAIL if any failed, PASS if any passed,
    else SKIP (INFO checks decide nothing)."""
    statuses = {c.status for c in checks}
    if FAIL in statuses:
        return FAIL
    return PASS if PASS in statuses else SKIP


@dataclass
class StepResult:
    """What one doctor step found.

    Attributes:
        name: the step's name (``--skip`` uses it).
        title: a short human title.
        status: PASS, FAIL or SKIP.
        figure: the key figure, one line.
        reason: why it failed or was skipped (or a note on a pass).
        checks: the individual verdicts.
        data: every measurement of the step (JSON-ready).
        files: names of the files the step wrote (top level or archived).
        seconds: how long the step took.
    """

    name: str
    title: str
    status: str
    figure: str = ""
    reason: str = ""
    checks: list[Check] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "status": self.status,
            "figure": self.figure,
            "reason": self.reason,
            "seconds": self.seconds,
            "checks": [c.to_json() for c in self.checks],
            "data": jsonable(self.data),
            "files": self.files,
        }


def jsonable(value: Any) -> Any:
    """``value`` with devices, paths, tuples and dataclasses turned into JSON types."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    if isinstance(value, (torch.device, Path)):
        return str(value)
    return value


@dataclass(frozen=True)
class Sizes:
    """How big each step's work is. See :data:`FULL` for the GPU time budget.

    Attributes:
        experiment: the tutorial's experiment (step 6), whose ``split_sizes``
            are the split sizes compared (and profiled in step 7).
        idris_repeat: timed epochs per variant of the IDRIS loop.
        loader_workers: DataLoader workers of the IDRIS loop.
        resnet_image: image side of the ResNet correctness check.
        resnet_batch: images in the ResNet correctness check.
        probe_ms: per-task time of the overlap probes.
        probe_micros: micro-batches of the overlap probes.
        probe_repeat: timed runs per probe (the median is used).
        sanitizer_timeout_s: limit of the CSAN subprocess.
        memcheck_timeout_s: limit of the compute-sanitizer subprocess.
        soak_steps: training steps of the memory soak.
        soak_warmup: steps before the memory baseline is taken.
        profile_steps: profiled training steps per split size.
        peak_config: model sizes of the peak-memory table.
    """

    experiment: Config
    idris_repeat: int
    loader_workers: int
    resnet_image: int
    resnet_batch: int
    probe_ms: float
    probe_micros: int
    probe_repeat: int
    sanitizer_timeout_s: int
    memcheck_timeout_s: int
    soak_steps: int
    soak_warmup: int
    profile_steps: int
    peak_config: Config


# The default run, sized for one H100/H200 in under 9 minutes (times per
# step measured on the H100 in docs/doctor.md): the tutorial's sizes, split sizes 12 and 20.
FULL = Sizes(
    experiment=dataclasses.replace(BENCH_FULL, repeat=5, warmup=1, split_sizes=(12, 20)),
    idris_repeat=5,
    loader_workers=4,
    resnet_image=64,
    resnet_batch=8,
    probe_ms=2.0,
    probe_micros=8,
    probe_repeat=5,
    sanitizer_timeout_s=180,
    memcheck_timeout_s=150,
    soak_steps=200,
    soak_warmup=10,
    profile_steps=3,
    peak_config=BENCH_FULL,
)

# --quick: a CPU-sized experiment (split sizes scaled to the 16-image batch)
# and shorter soak and probes; about a minute on two CPU cores.
QUICK = Sizes(
    experiment=dataclasses.replace(BENCH_QUICK, repeat=3, warmup=1, split_sizes=(4, 8)),
    idris_repeat=3,
    loader_workers=0,
    resnet_image=32,
    resnet_batch=4,
    probe_ms=1.0,
    probe_micros=6,
    probe_repeat=3,
    sanitizer_timeout_s=120,
    memcheck_timeout_s=90,
    soak_steps=60,
    soak_warmup=5,
    profile_steps=3,
    peak_config=dataclasses.replace(BENCH_QUICK, batch_size=32),
)

# For the test suite: every step's code path at the smallest sizes.
TINY = Sizes(
    experiment=Config(
        num_batches=1,
        batch_size=4,
        image_w=32,
        image_h=32,
        num_classes=10,
        repeat=1,
        warmup=0,
        split_size=2,
        split_sizes=(2, 4),
    ),
    idris_repeat=1,
    loader_workers=0,
    resnet_image=32,
    resnet_batch=4,
    probe_ms=1.0,
    probe_micros=4,
    probe_repeat=1,
    sanitizer_timeout_s=60,
    memcheck_timeout_s=30,
    soak_steps=8,
    soak_warmup=2,
    profile_steps=1,
    peak_config=Config(
        num_batches=1, batch_size=4, image_w=32, image_h=32, num_classes=10, split_size=2
    ),
)


@dataclass
class Context:
    """What every step gets: devices, sizes, where to write, and earlier steps' results.

    Attributes:
        devices: the two devices of the pipelines (the same one twice on one GPU).
        sizes: how big the work is.
        arch: ``'resnet50'`` or ``'resnet101'``.
        out: the report folder (top-level files).
        scratch: files that go into the report's archive.
        progress: whether to show progress bars.
        shared: results later steps reuse (e.g. step 7's profiles).
    """

    devices: tuple[torch.device, torch.device]
    sizes: Sizes
    arch: str
    out: Path
    scratch: Path
    progress: bool = False
    shared: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        """Whether the pipelines run on CUDA devices."""
        return self.devices[0].type == "cuda"

    @property
    def two_gpus(self) -> bool:
        """Whether the two stages sit on two different GPUs."""
        return self.cuda and self.devices[0] != self.devices[1]

    def bar(self, total: int, desc: str) -> Any:
        """A tqdm progress bar that only draws on a terminal (and not with ``--no-progress``)."""
        from tqdm import tqdm

        # disable=None: tqdm draws only when stderr is a terminal, so logs stay clean.
        return tqdm(
            total=total, desc=desc, leave=False, unit="run", disable=None if self.progress else True
        )

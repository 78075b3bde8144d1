"""The tutorial's experiment, timed: single device vs the tutorial's models vs mpstream.

Each measurement is one call of the tutorial's ``train`` (``num_batches``
mini-batches of random images, MSELoss, SGD) timed with the host clock, as
the tutorial's ``timeit.repeat(number=1)`` times it, but with the devices
synchronised before and after (the tutorial's does not synchronise, so its
last backward and SGD step may still run when its clock stops), and
warm-up calls excluded (the tutorial's first call pays for initialisation).
:func:`run` measures the four models at one split size (and, on GPUs, the
models replaying CUDA graphs: mpstream's graphed stages, the single device
captured whole and, when both halves share a GPU, mpstream with each step
captured whole: :mod:`mpstream.tutorial.graphed`) and sweeps the split
size for the pipelines. The models, the sizes and the
records are :mod:`.design`'s; :mod:`.report` prints a run and saves the JSON
and the tutorial's three figures. The experiment's devices, and what the
JSON says of the machine and the code, come from :mod:`.machine`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..pipe import SingleMicroBatchWarning
from ..runtime import GraphWarning, synchronize
from . import graphed, rounds
from . import models as tutorial
from .design import (
    FULL,
    GRAPHED,
    MODELS,
    PIPELINES,
    QUICK,
    SINGLE_GRAPHED,
    STAGE_GRAPHS,
    Config,
    Measurement,
    Results,
    label,
    left_out,
    models_for,
    swept,
)
from .loops import train

# Re-exported: the commands and the doctor reach them as bench's.
from .machine import detect_devices, device_name, git_commit, metadata
from .report import save, table

# Re-exported besides its own: Config, QUICK, FULL, MODELS, save and table
# because docs/benchmarks.md shows them as bench's; PIPELINES, the graphed
# models' names, models_for, left_out and swept because benchmarks/ reaches
# them as bench's.
__all__ = [
    "Config",
    "QUICK",
    "FULL",
    "MODELS",
    "PIPELINES",
    "GRAPHED",
    "STAGE_GRAPHS",
    "SINGLE_GRAPHED",
    "models_for",
    "left_out",
    "swept",
    "detect_devices",
    "device_name",
    "git_commit",
    "metadata",
    "make_model",
    "run",
    "save",
    "table",
]


def make_model(
    name: str, dev0: torch.device, dev1: torch.device, config: Config, split_size: int
) -> nn.Module:
    """One of :data:`MODELS` of ``config.arch``, freshly initialised.

    Raises:
        ValueError: an unknown model name or architecture.
    """
    n = config.num_classes
    deep = config.arch == "resnet101"
    if name == "single device":
        return tutorial.single_device(config.arch, dev0, n)
    if name == "model parallel":
        parallel = tutorial.ModelParallelResNet101 if deep else tutorial.ModelParallelResNet50
        return parallel(dev0, dev1, n)
    if name == "tutorial pipeline":
        pipeline = tutorial.PipelineParallelResNet101 if deep else tutorial.PipelineParallelResNet50
        return pipeline(dev0, dev1, split_size, n)
    if name in ("mpstream", STAGE_GRAPHS):
        stream = tutorial.StreamPipelineResNet101 if deep else tutorial.StreamPipelineResNet50
        return stream(dev0, dev1, split_size, n, graphs=name == STAGE_GRAPHS)
    if name == SINGLE_GRAPHED:
        return graphed.GraphedSingleDevice(config.arch, dev0, n)
    if name == GRAPHED:
        graph = graphed.GraphedPipelineResNet101 if deep else graphed.GraphedPipelineResNet50
        return graph(dev0, dev1, split_size, n)
    raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODELS)}")


def train_once(model: nn.Module, config: Config, devices: Sequence[torch.device]) -> float:
    """One synchronised call of the tutorial's train loop; returns seconds."""
    synchronize(devices)
    start = time.perf_counter()
    train(
        model,
        num_batches=config.num_batches,
        batch_size=config.batch_size,
        image_w=config.image_w,
        image_h=config.image_h,
        num_classes=config.num_classes,
        input_device=devices[0],
    )
    synchronize(devices)
    return time.perf_counter() - start


def calls(config: Config, sweep: bool, models: Sequence[str] = MODELS) -> int:
    """Number of train calls :func:`run` makes (for progress bars), for ``models``
    (:func:`models_for` the devices)."""
    sizes = set(config.split_sizes) | {config.split_size} if sweep else {config.split_size}
    split = len(swept(models))
    configurations = len(models) - split + split * len(sizes)
    return (config.warmup + config.repeat) * configurations


def run(
    config: Config,
    dev0: torch.device,
    dev1: torch.device,
    *,
    sweep: bool = True,
    tick: Callable[[], None] | None = None,
    status: Callable[[str], None] | None = None,
    interruptible: bool = False,
) -> Results:
    """Measures the models (:func:`models_for` the devices) and, with ``sweep``,
    the pipelines (and the CUDA graph, on one device) at every split size.

    All configurations are built first and timed round-robin, one call each
    per round with the starting point rotating, so slow drift of the machine
    (clocks, temperature, other load) spreads over all of them instead of
    biasing the ratios; where they do not all fit in device memory, in
    groups that do (:mod:`.rounds`; each measurement names its group).
    With ``interruptible``, a ``KeyboardInterrupt`` ends the run with what
    was timed (the results' ``not_timed`` names the rest); else it
    propagates.

    Raises:
        torch.cuda.OutOfMemoryError: a configuration does not fit even alone.
        RuntimeError: a graphed model's stages run eagerly for another reason.
    """
    devices = (dev0, dev1)
    load = {"before": rounds.machine_load()}
    names = models_for(dev0, dev1)
    takes_split = swept(names)
    main = [(name, config.split_size if name in takes_split else None) for name in names]
    sweep_keys: list[tuple[str, int | None]] = (
        [(name, s) for name in takes_split for s in config.split_sizes] if sweep else []
    )
    # The main split size usually appears in the sweep too: time it once.
    keys = list(dict.fromkeys(main + sweep_keys))

    def build(key: tuple[str, int | None]) -> nn.Module:
        name, split = key
        torch.manual_seed(0)
        return make_model(name, dev0, dev1, config, split or config.split_size)

    with warnings.catch_warnings():
        # A graphed stage whose capture failed runs eagerly with a
        # GraphWarning; graphed.check_stages turns that into NoRoom or an
        # error. Other GraphWarnings (calls beyond the bound) still show.
        warnings.filterwarnings("ignore", ".* runs eagerly: ", GraphWarning)
        # A configuration of one micro-batch is measured on purpose.
        warnings.simplefilter("ignore", SingleMicroBatchWarning)
        timed = rounds.round_robin(
            keys,
            build,
            lambda model: train_once(model, config, devices),
            warmup=config.warmup,
            repeat=config.repeat,
            label=label,
            check=_check,
            tick=tick,
            status=status,
            interruptible=interruptible,
        )
    measured = {
        key: Measurement(*key, times=timed.times[key], group=timed.group[key])
        for key in keys
        if key in timed.times
    }
    load["after"] = rounds.machine_load()
    not_timed = [label(k) for k in keys if k not in measured] if timed.interrupted else None
    return Results(
        config,
        devices,
        [measured[k] for k in main if k in measured],
        [measured[k] for k in sweep_keys if k in measured],
        load,
        not_timed,
    )


def _check(key: tuple[str, int | None], model: nn.Module) -> None:
    """A graphed-stages model must replay graphs (:func:`graphed.check_stages`)."""
    if key[0] == STAGE_GRAPHS:
        graphed.check_stages(label(key), model)

"""The tutorial's experiment, timed: single device vs the tutorial's models vs mpstream.

Each measurement is one call of the tutorial's ``train`` (``num_batches``
mini-batches of random images, MSELoss, SGD) timed with the host clock, with
device work synchronised inside the timed region, as the tutorial's
``timeit.repeat(number=1)`` does, and warm-up calls excluded (which the
tutorial's does not: its first call pays for initialisation). :func:`run` measures the
four models at one split size (and, when both halves share a GPU, mpstream
with each step replayed as a CUDA graph: :mod:`mpstream.tutorial.graphed`)
and sweeps the split size for both pipelines; :func:`save` writes the JSON
and the tutorial's three figures. The experiment's devices, and what the
JSON says of the machine and the code, come from :mod:`.machine`.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..runtime import GraphWarning, explicit_device, synchronize
from . import graphed, rounds
from . import models as tutorial

# Re-exported: the commands and the doctor reach them as bench's.
from .machine import detect_devices, device_name, git_commit, metadata

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
    "detect_devices",
    "device_name",
    "git_commit",
    "metadata",
    "make_model",
    "run",
    "save",
    "table",
    "noisy_spreads",
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
    """Sizes and repetitions of the experiment (defaults: the tutorial's)."""

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

    @property
    def noisy(self) -> list[Measurement]:
        """The configurations whose rounds disagree (each once)."""
        unique = {id(m): m for m in self.models + self.sweep}
        return [m for m in unique.values() if m.noisy]

    def get(self, model: str, split_size: int | None = None) -> Measurement:
        for m in self.models + self.sweep:
            if m.model == model and (split_size is None or m.split_size == split_size):
                return m
        raise KeyError((model, split_size))


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
    tutorial.train(
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
) -> Results:
    """Measures the models (:func:`models_for` the devices) and, with ``sweep``,
    the pipelines (and the CUDA graph, on one device) at every split size.

    All configurations are built first and timed round-robin, one call each
    per round with the starting point rotating, so slow drift of the machine
    (clocks, temperature, other load) spreads over all of them instead of
    biasing the ratios; where they do not all fit in device memory, in
    groups that do (:mod:`.rounds`; each measurement names its group).

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
        timed = rounds.round_robin(
            keys,
            build,
            lambda model: train_once(model, config, devices),
            warmup=config.warmup,
            repeat=config.repeat,
            label=_label,
            check=_check,
            tick=tick,
            status=status,
        )
    measured = {
        key: Measurement(*key, times=timed.times[key], group=timed.group[key]) for key in keys
    }
    load["after"] = rounds.machine_load()
    return Results(
        config, devices, [measured[k] for k in main], [measured[k] for k in sweep_keys], load
    )


def _check(key: tuple[str, int | None], model: nn.Module) -> None:
    """A graphed-stages model must replay graphs (:func:`graphed.check_stages`)."""
    if key[0] == STAGE_GRAPHS:
        graphed.check_stages(_label(key), model)


def _label(key: tuple[str, int | None]) -> str:
    """A configuration's name: the model, and its split size if it has one."""
    name, split = key
    return name if split is None else f"{name} (split {split})"


def baseline(results: Results, model: str) -> str:
    """The model ``model`` is compared with: a graphed one's baseline
    captured the same way where it was measured (:data:`GRAPHS`), else the
    eager single device."""
    like = GRAPHS.get(model)
    measured = {m.model for m in results.models}
    return like if like is not None and like in measured else "single device"


def to_json(results: Results) -> dict[str, Any]:
    """The JSON document of a run: each model's speed-up against the eager
    single device, and against its own baseline (:func:`baseline`)."""
    single = results.get("single device").mean

    def speedups(m: Measurement) -> dict[str, Any]:
        like = baseline(results, m.model)
        return {
            "speedup_vs_single": single / m.mean,
            "baseline": like,
            "speedup_vs_baseline": results.get(like).mean / m.mean,
            # A ratio is as noisy as the noisier of its two measurements.
            "ratio_noisy": m.noisy or results.get(like).noisy,
        }

    return {
        **metadata(results.devices),
        "config": dataclasses.asdict(results.config),
        "timing": (
            "host clock around synchronised train() calls; warm-up calls excluded; "
            "configurations timed round-robin"
        ),
        "models": [{**m.to_json(), **speedups(m)} for m in results.models],
        "not_measured": left_out(*results.devices),
        "split_sweep": [m.to_json() for m in results.sweep],
        "load": results.load,
        "noise": {
            "max_cv": rounds.MAX_CV,
            "max_over_min": rounds.MAX_RANGE,
            "noisy": list(noisy_spreads(results)),
            "note": rounds.NOISY if results.noisy else None,
        },
    }


def save(results: Results, out: Path, *, plots: bool = True) -> list[Path]:
    """Writes ``results.json`` and the tutorial's three figures into ``out``.

    Returns:
        The files written.
    """
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json"]
    written[0].write_text(json.dumps(to_json(results), indent=2) + "\n")
    if plots:
        from ..observe import figures

        written += figures.tutorial_figures(results, out)
    return written


def table(results: Results) -> str:
    """Mean ± std per model and speed-up against its baseline: the single
    device, captured the same way for a graphed model (:func:`baseline`).

    A ``*`` marks a noisy measurement (or a ratio with one), explained below
    the table with the machine's load (:mod:`.rounds`).
    """
    header = (
        f"{'model':<25} {'split':>5} {'mean ± std (s)':>17} {'median (s)':>10} "
        f"{'speed-up':>8}  against"
    )
    lines = [header, "-" * len(header)]
    for r in results.models:
        split = "-" if r.split_size is None else str(r.split_size)
        like = baseline(results, r.model)
        star = "*" if r.noisy or results.get(like).noisy else " "
        lines.append(
            f"{r.model:<25} {split:>5} {r.mean:>9.3f} ± {r.std:<5.3f} {r.median:>10.3f} "
            f"{results.get(like).mean / r.mean:>7.2f}x{star} {like}"
        )
    for name, why in left_out(*results.devices).items():
        lines.append(f"{name}: not measured, {why}")
    groups = {m.group for m in results.models + results.sweep}
    if len(groups) > 1:
        lines.append(
            f"timed in {len(groups)} groups: not every configuration fit in device memory at "
            f"once, so ratios across groups are not drift-free (results.json names each one's)"
        )
    if results.sweep:
        lines.append("")
        names = list(dict.fromkeys(m.model for m in results.sweep))
        lines.append("split-size sweep, mean (s): " + "  ".join(names))
        for s in results.config.split_sizes:
            row = [_mark(results.get(p, s)) for p in names]
            lines.append(f"  split {s:>3}: " + "  ".join(f"{v:>17}" for v in row))
    lines += rounds.noise_lines(noisy_spreads(results), results.load)
    return "\n".join(lines)


def noisy_spreads(results: Results) -> dict[str, rounds.Spread]:
    """The noisy configurations by name, each with its spread."""
    return {_label((m.model, m.split_size)): m.spread for m in results.noisy}


def _mark(m: Measurement) -> str:
    return f"{m.mean:.3f}" + ("*" if m.noisy else " ")

"""The tutorial's figures, with mpstream added (matplotlib, no display needed).

This module draws; it imports no other mpstream module. What it draws from
is described by protocols (:class:`BenchResults`), which ``mpstream bench``'s
results satisfy, so the tools that call it (bench, timeline, tuning) do not
form an import circle through it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import cycle
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = [
    "bar_chart",
    "memory_bars",
    "throughput_curves",
    "split_curves",
    "tutorial_figures",
    "pyplot",
    "save",
    "Timed",
    "Rounds",
    "error_bars",
    "NOISY_NOTE",
    "Sizes",
    "BenchResults",
    "MODEL_NAMES",
]

# How the figures name each architecture of bench.Config.arch.
MODEL_NAMES = {"resnet50": "ResNet50", "resnet101": "ResNet-101"}


class Rounds(Protocol):
    """How a configuration's rounds spread: the fastest, the slowest, and
    whether they disagree beyond the bench's limits."""

    @property
    def low(self) -> float: ...

    @property
    def high(self) -> float: ...

    @property
    def noisy(self) -> bool: ...


class Timed(Protocol):
    """One measured configuration: a model at a split size."""

    @property
    def model(self) -> str: ...

    @property
    def split_size(self) -> int | None: ...

    @property
    def mean(self) -> float: ...

    @property
    def spread(self) -> Rounds: ...


class Sizes(Protocol):
    """The experiment's sizes, for the figures' titles."""

    @property
    def num_batches(self) -> int: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def image_w(self) -> int: ...

    @property
    def image_h(self) -> int: ...

    @property
    def arch(self) -> str: ...

    @property
    def repeat(self) -> int: ...


class BenchResults(Protocol):
    """What :func:`tutorial_figures` reads (``mpstream.tutorial.design.Results`` has it)."""

    @property
    def config(self) -> Sizes: ...

    @property
    def devices(self) -> tuple[torch.device, torch.device]: ...

    @property
    def models(self) -> Sequence[Timed]: ...

    @property
    def sweep(self) -> Sequence[Timed]: ...

    def get(self, model: str, split_size: int | None = None) -> Timed: ...


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, ax: Any, path: Path, title: str = "", **title_kw: Any) -> Path:
    """Titles, lays out, writes and closes a figure.

    Args:
        fig: the figure.
        ax: the axes the title goes on.
        path: the file to write, its format from its suffix; without one,
            a PNG at ``path`` with ``.png`` added.
        title: the title, if any.
        **title_kw: more of ``ax.set_title``'s arguments.

    Returns:
        The file written.

    Raises:
        ValueError: ``path`` is a folder.
    """
    if path.is_dir():
        # matplotlib wrote such a figure beside the folder, as <folder>.png.
        pyplot().close(fig)
        raise ValueError(
            f"{path} is a folder: give the figure's file, such as {path / 'figure.png'}"
        )
    # matplotlib adds .png to a name without a suffix: return the file it writes.
    written = path if path.suffix else path.with_name(path.name + ".png")
    if title:
        ax.set_title(title, fontsize=9, **title_kw)
    fig.tight_layout()
    fig.savefig(written, dpi=120)
    pyplot().close(fig)
    return written


#: Said on a figure with a noisy point, and the mark that points to it.
NOISY_NOTE = "noisy: its rounds disagree; rerun on a quiet machine or with more rounds"
NOISY_MARK = " *"


def error_bars(
    centres: Sequence[float], bounds: Sequence[tuple[float, float]]
) -> list[list[float]]:
    """matplotlib's asymmetric ``yerr`` from each centre to its (low, high)
    bounds: never below zero, as a standard deviation drawn both ways can be."""
    return [
        [max(c - lo, 0.0) for c, (lo, _) in zip(centres, bounds)],
        [max(hi - c, 0.0) for c, (_, hi) in zip(centres, bounds)],
    ]


def bar_chart(
    means: Sequence[float],
    bounds: Sequence[tuple[float, float]],
    labels: Sequence[str],
    path: Path,
    title: str = "",
    model: str = "ResNet50",
    *,
    spread: str = "mean; bars: fastest to slowest",
    xlabel: str = "model",
    noisy: Sequence[bool] = (),
) -> Path:
    """The tutorial's bar chart: mean execution time, error bars from the
    fastest to the slowest call (``bounds``, never below zero).

    ``spread`` says on the y axis what the bars and error bars are; a bar
    whose ``noisy`` is true is hatched, its label marked, and the title
    says why (:data:`NOISY_NOTE`).
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(means), 4.2))
    x = range(len(means))
    flags = list(noisy) or [False] * len(means)
    ax.bar(
        x,
        means,
        yerr=error_bars(means, bounds),
        align="center",
        alpha=0.5,
        ecolor="red",
        capsize=10,
        width=0.6,
        hatch=["//" if n else "" for n in flags],
    )
    ax.set_ylabel(f"{model} execution time (s)\n{spread}")
    ax.set_xlabel(xlabel)
    ax.set_xticks(list(x))
    ax.set_xticklabels(
        [label + (NOISY_MARK if n else "") for label, n in zip(labels, flags)], fontsize=9
    )
    ax.set_ylim(bottom=0)
    ax.yaxis.grid(True)
    return save(fig, ax, path, _noted(title, "*" if any(flags) else ""))


def split_curves(
    curves: Mapping[str, tuple[Sequence[int], Sequence[float], Sequence[tuple[float, float]]]],
    path: Path,
    title: str = "",
    model: str = "ResNet50",
    *,
    spread: str = "mean; bars: fastest to slowest",
    noisy: Mapping[str, Sequence[bool]] | None = None,
    timed: str = "execution time",
) -> Path:
    """Execution time against split size, one curve per pipeline, error bars
    to each point's (low, high) bounds (never below zero).

    ``spread`` says on the y axis what the points and error bars are, and
    ``model`` and ``timed`` what was timed; ``noisy`` points (per curve)
    are circled and the title says why.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ticks: set[int] = set()
    circled = False
    # Markers repeat beyond the fourth curve: none is left out.
    for (label, (sizes, centres, bounds)), marker in zip(curves.items(), cycle("os^v")):
        ax.errorbar(
            sizes, centres, yerr=error_bars(centres, bounds), marker=marker, capsize=4, label=label
        )
        flags = (noisy or {}).get(label, ())
        bad = [(s, c) for s, c, n in zip(sizes, centres, flags) if n]
        if bad:
            ax.scatter(
                *zip(*bad),
                s=160,
                facecolors="none",
                edgecolors="red",
                label=None if circled else "noisy",
                zorder=3,
            )
            circled = True
        ticks.update(sizes)
    ax.set_ylabel(f"{model} {timed} (s)\n{spread}".lstrip())
    ax.set_xlabel("Pipeline split size")
    ax.set_xticks(sorted(ticks))
    ax.set_ylim(bottom=0)
    ax.yaxis.grid(True)
    ax.legend()
    return save(fig, ax, path, _noted(title, "circled" if circled else ""))


def _noted(title: str, mark: str) -> str:
    """``title``, with :data:`NOISY_NOTE` after the ``mark`` of noisy points
    on a line of its own (no mark: none is noisy)."""
    return f"{title}\n{mark} {NOISY_NOTE}" if mark else title


def throughput_curves(
    curves: Mapping[str, tuple[Sequence[int], Sequence[float]]],
    flat: Mapping[str, float],
    path: Path,
    title: str = "",
) -> Path:
    """Tokens per second against micro-batches, a curve per pipeline, and a
    dashed line per baseline that has no micro-batches."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ticks: set[int] = set()
    for (name, (xs, ys)), marker in zip(curves.items(), cycle("os^vD<>")):
        ax.plot(xs, ys, marker=marker, label=name)
        ticks.update(xs)
    for (name, value), style in zip(flat.items(), cycle(("--", ":", "-."))):
        ax.axhline(value, linestyle=style, color="gray", label=name)
    ax.set_xlabel("micro-batches per step")
    ax.set_ylabel("tokens per second (median step)")
    ax.set_xticks(sorted(ticks))
    ax.yaxis.grid(True)
    ax.legend(fontsize=8)
    return save(fig, ax, path, title)


def memory_bars(
    configurations: Mapping[str, Sequence[Mapping[str, int]]],
    path: Path,
    title: str = "",
    kinds: Sequence[str] = ("parameters", "gradients", "optimizer", "activations"),
) -> Path:
    """Memory per stage as stacked bars: one group of bars per
    configuration, one bar per stage, stacked by ``kinds`` (bytes, drawn in
    GiB, or MiB where no bar reaches one GiB)."""
    plt = pyplot()
    bars = [(name, s, stage) for name, stages in configurations.items()
            for s, stage in enumerate(stages)]  # fmt: skip
    fig, ax = plt.subplots(figsize=(2.0 + 0.7 * len(bars), 4.6))
    tallest = max((sum(stage.get(k, 0) for k in kinds) for _, _, stage in bars), default=0)
    unit, scale = ("GiB", 2**30) if tallest >= 2**30 else ("MiB", 2**20)
    bottoms = [0.0] * len(bars)
    for kind in kinds:
        heights = [stage.get(kind, 0) / scale for _, _, stage in bars]
        ax.bar(range(len(bars)), heights, bottom=bottoms, label=kind, width=0.7)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([f"{name}\nstage {s}" for name, s, _ in bars], fontsize=6, rotation=60)
    ax.set_ylabel(f"{unit} per stage (measured)")
    ax.yaxis.grid(True)
    ax.legend(fontsize=8)
    return save(fig, ax, path, title)


def tutorial_figures(results: BenchResults, out: Path) -> list[Path]:
    """``mp_vs_rn.png``, ``mp_vs_rn_vs_pp.png`` and ``split_size_tradeoff.png``."""
    dev0, dev1 = results.devices
    single = "Single GPU" if dev0.type == "cuda" else "Single device"
    c = results.config
    where = f"{dev0} | {dev1}" if dev0 != dev1 else f"both halves on {dev0}"
    title = f"{where}; {c.num_batches} x {c.batch_size} images of {c.image_w}x{c.image_h}"
    model = MODEL_NAMES.get(c.arch, c.arch)
    spread = f"mean; bars: fastest to slowest of {c.repeat} train() calls"
    mp, rn = results.get("model parallel"), results.get("single device")
    pp, ms = results.get("tutorial pipeline"), results.get("mpstream")
    bars = [
        (mp, "Model Parallel"),
        (rn, single),
        (pp, f"Pipelining\n(tutorial, {pp.split_size})"),
        (ms, f"mpstream\n(streams, {ms.split_size})"),
    ]
    # The graphed models, when measured (a GPU): named as mpstream.tutorial.bench does.
    graphed = {
        "single device, CUDA graph": lambda m: f"{single}\n(CUDA graph)",
        "mpstream, graphed stages": lambda m: f"mpstream\n(graphed stages, {m.split_size})",
        "mpstream, CUDA graph": lambda m: f"mpstream\n(CUDA graph, {m.split_size})",
    }
    bars += [(m, graphed[m.model](m)) for m in results.models if m.model in graphed]
    paths = [
        bar_chart(
            [mp.mean, rn.mean],
            [_bounds(mp), _bounds(rn)],
            ["Model Parallel", single],
            out / "mp_vs_rn.png",
            title,
            model,
            spread=spread,
            noisy=[mp.spread.noisy, rn.spread.noisy],
        ),
        bar_chart(
            [m.mean for m, _ in bars],
            [_bounds(m) for m, _ in bars],
            [label for _, label in bars],
            out / "mp_vs_rn_vs_pp.png",
            title,
            model,
            spread=spread,
            xlabel="model (split size)",
            noisy=[m.spread.noisy for m, _ in bars],
        ),
    ]
    if results.sweep:
        labels = {
            "tutorial pipeline": "tutorial (default stream)",
            "mpstream": "mpstream (streams + events)",
            "mpstream, graphed stages": "mpstream + graphed stages",
            "mpstream, CUDA graph": "mpstream + CUDA graph (whole step)",
        }
        curves = {}
        noisy = {}
        for name in dict.fromkeys(m.model for m in results.sweep):
            ms_ = [m for m in results.sweep if m.model == name]
            label = labels.get(name, name)
            curves[label] = (
                [int(m.split_size or 0) for m in ms_],
                [m.mean for m in ms_],
                [_bounds(m) for m in ms_],
            )
            noisy[label] = [m.spread.noisy for m in ms_]
        paths.append(
            split_curves(
                curves, out / "split_size_tradeoff.png", title, model, spread=spread, noisy=noisy
            )
        )
    return paths


def _bounds(m: Timed) -> tuple[float, float]:
    return (m.spread.low, m.spread.high)

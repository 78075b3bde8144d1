"""A run of the tutorial's experiment, told: its JSON document, its table, its figures.

Each model's speed-up is against its baseline (:func:`baseline`): the eager
single device, or for a graphed model the single device captured the same
way. :func:`save` writes ``results.json`` and the tutorial's three figures;
:func:`table` prints the run, a ``*`` marking a noisy measurement.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .._words import count_of
from . import rounds
from .design import GRAPHS, Measurement, Results, label, left_out
from .machine import metadata

__all__ = ["baseline", "to_json", "save", "table", "noisy_spreads"]


def baseline(results: Results, model: str) -> str:
    """The model ``model`` is compared with: a graphed one's baseline
    captured the same way where it was measured (:data:`GRAPHS`), else the
    eager single device (which an interrupted run may not have timed)."""
    like = GRAPHS.get(model)
    measured = {m.model for m in results.models}
    return like if like is not None and like in measured else "single device"


def to_json(results: Results) -> dict[str, Any]:
    """The JSON document of a run: each model's speed-up against the eager
    single device, and against its own baseline (:func:`baseline`); None
    against one an interrupted run did not time."""
    single = results.find("single device")

    def speedups(m: Measurement) -> dict[str, Any]:
        like = baseline(results, m.model)
        base = results.find(like)
        return {
            "speedup_vs_single": None if single is None else single.mean / m.mean,
            "baseline": like,
            "speedup_vs_baseline": None if base is None else base.mean / m.mean,
            # A ratio is as noisy as the noisier of its two measurements.
            "ratio_noisy": m.noisy or (base is not None and base.noisy),
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
        "interrupted": results.interrupted,
        "not_timed": results.not_timed or [],
        "load": results.load,
        "noise": {
            "max_cv": rounds.MAX_CV,
            "max_over_min": rounds.MAX_RANGE,
            "noisy": list(noisy_spreads(results)),
            "note": rounds.NOISY if results.noisy else None,
        },
    }


# What :func:`save` draws (mpstream.observe.figures.tutorial_figures).
_FIGURES = ("mp_vs_rn.png", "mp_vs_rn_vs_pp.png", "split_size_tradeoff.png")


def save(results: Results, out: Path, *, plots: bool = True) -> list[Path]:
    """Writes ``results.json`` and the tutorial's three figures into ``out``
    (the figures need every model: not after an interrupt); an earlier
    run's figures there are removed either way.

    Returns:
        The files written.
    """
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json"]
    written[0].write_text(json.dumps(to_json(results), indent=2) + "\n")
    # An earlier run's figures would sit beside this run's numbers.
    for name in _FIGURES:
        (out / name).unlink(missing_ok=True)
    if plots and not results.interrupted:
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
        base = results.find(like)
        star = "*" if r.noisy or (base is not None and base.noisy) else " "
        speedup = "       -" if base is None else f"{base.mean / r.mean:>7.2f}x"
        lines.append(
            f"{r.model:<25} {split:>5} {r.mean:>9.3f} ± {r.std:<5.3f} {r.median:>10.3f} "
            f"{speedup}{star} {like}"
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
        widths = [max(17, len(n)) for n in names]
        lines.append("split-size sweep, mean (s):")
        lines.append(" " * 13 + "  ".join(f"{n:>{w}}" for n, w in zip(names, widths)))
        for s in results.config.split_sizes:
            row = [_mark(results.find(p, s)) for p in names]
            lines.append(f"  split {s:>3}: " + "  ".join(f"{v:>{w}}" for v, w in zip(row, widths)))
    if results.not_timed is not None:
        repeat = results.config.repeat
        unique = {id(m): m for m in results.models + results.sweep}.values()
        short = [label((m.model, m.split_size)) for m in unique if len(m.times) < repeat]
        said = [f"fewer than {repeat} rounds: {', '.join(short)}"] if short else []
        said += [f"not timed: {', '.join(results.not_timed)}"] if results.not_timed else []
        lines.append(
            "interrupted: the figures above are what ran before it; figures not drawn"
            + "".join(f"; {part}" for part in said)
        )
    lines += _what_is_timed(results)
    lines += rounds.noise_lines(noisy_spreads(results), results.load)
    return "\n".join(lines)


def _what_is_timed(results: Results) -> list[str]:
    """What one time of the table is, and on the CPU that it is no GPU's
    (a CPU run's table reads like one otherwise)."""
    c = results.config
    batches = f"{c.num_batches} batch{'' if c.num_batches == 1 else 'es'}"
    images = f"{c.batch_size} image{'' if c.batch_size == 1 else 's'}"
    said = [
        f"each time: one synchronised train() call, in seconds ({batches} of {images} of "
        f"{c.image_w}x{c.image_h}: forward, MSELoss, backward, SGD); "
        f"{count_of(c.repeat, 'round')} after {c.warmup} warm-up, the configurations "
        f"round-robin"
    ]
    if all(d.type == "cpu" for d in results.devices):
        said.append(
            "CPU: both halves run on the host, one task after another; nothing overlaps, so "
            "no pipeline can be faster here: these are not GPU numbers"
        )
    return said


def noisy_spreads(results: Results) -> dict[str, rounds.Spread]:
    """The noisy configurations by name, each with its spread."""
    return {label((m.model, m.split_size)): m.spread for m in results.noisy}


def _mark(m: Measurement | None) -> str:
    if m is None:  # not timed: an interrupted run
        return "- "
    return f"{m.mean:.3f}" + ("*" if m.noisy else " ")

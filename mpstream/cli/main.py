"""The ``mpstream`` command line (also ``python -m mpstream``).

Each command first says what it lacks of the optional extras
(:mod:`.extras`), then checks its options: a bad one exits 2 with argparse's
one-line error (:class:`.argtypes.UsageError`), before anything is measured.
An error while running is no bad option: it keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .._version import __version__
from ..tutorial.machine import detect_devices, device_name, metadata
from ..workloads.transformer import PRESETS
from . import doctor as cli_doctor
from . import extras
from . import schedules as cli_schedules
from . import transformer as cli_transformer
from .argtypes import (
    UsageError,
    image_size,
    int_list,
    non_negative_int,
    positive_float,
    positive_int,
)

if TYPE_CHECKING:  # the ResNet experiment's modules need torchvision: imported in the commands
    from ..tutorial.bench import Config

__all__ = ["main", "parser"]

#: What each command needs of the optional packages, given its options.
NEEDS: dict[str, Callable[[argparse.Namespace], tuple[str, ...]]] = {
    # A transformer's option without --model transformer is refused first: the
    # user meant the transformer, which needs no torchvision.
    "bench": lambda a: (
        ()
        if a.model == "transformer" or cli_transformer.given(a, cli_transformer.TRANSFORMER_ONLY)
        else ("torchvision",)
    ),
    "tune": lambda a: ("torchvision",),
    "trace": lambda a: ("torchvision",),
    "schedules": lambda a: () if a.uniform else ("torchvision",),
    "doctor": lambda a: cli_doctor.NEEDS,
}


def _devices(args: argparse.Namespace) -> tuple[torch.device, torch.device]:
    try:
        return detect_devices(args.devices)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _lone_image(width: int, height: int, batch: int, split: int) -> bool:
    """Whether a micro-batch of ``split`` images from a batch of ``batch``
    (the last one holds what is left) is a lone image ResNet50 brings down to
    one pixel: BatchNorm then sees one value per channel, which training
    refuses."""
    # Five stride-2 layers, each rounding up: a side of at most 32 ends at 1.
    one_pixel = -(-width // 32) * -(-height // 32) == 1
    return one_pixel and (split == 1 or batch % split == 1 or batch == 1)


def _config(args: argparse.Namespace) -> Config:
    from ..tutorial import bench

    config = bench.QUICK if args.quick else bench.FULL
    changes: dict[str, object] = {}
    for name in (
        "repeat",
        "warmup",
        "split_size",
        "split_sizes",
        "batch_size",
        "num_batches",
        "num_classes",
    ):
        value = getattr(args, name, None)
        if value is not None:
            changes[name] = value
    if args.image_size is not None:
        changes["image_w"], changes["image_h"] = args.image_size
    config = dataclasses.replace(config, **changes)  # type: ignore[arg-type]
    w, h = config.image_w, config.image_h
    if w < 32 or h < 32:
        raise UsageError("--image-size must be at least 32x32 (ResNet50 downsamples 32x)")
    batch = config.batch_size
    main = getattr(args, "split_size", None)  # tune has no main comparison
    given = [] if main is None else [main]
    over = [s for s in (*given, *(args.split_sizes or ())) if s > batch]
    if over:
        flag = "--split-size" if over[0] in given else "--split-sizes"
        raise UsageError(
            f"{flag} {over[0]}: larger than the batch of {batch} images (--batch-size)"
        )
    lone = [s for s in (*given, *(args.split_sizes or ())) if _lone_image(w, h, batch, s)]
    if lone:
        flag = "--split-size" if lone[0] in given else "--split-sizes"
        what = "--batch-size 1" if batch == 1 else f"{flag} {lone[0]}"
        raise UsageError(
            f"{what} with --image-size {w}x{h}: a micro-batch of one image, which ResNet50 "
            "brings down to one pixel, and BatchNorm cannot train on one value per channel; "
            "use micro-batches of 2 or more images, or images larger than 32x32"
        )
    if args.split_sizes is None:  # the default sweep, up to the batch
        kept = tuple(
            s for s in config.split_sizes if s <= batch and not _lone_image(w, h, batch, s)
        )
        config = dataclasses.replace(config, split_sizes=kept or (batch,))
    default = config.split_size
    if main is None and (default >= batch > 1 or _lone_image(w, h, batch, default)):
        # The default main split would leave one micro-batch (no pipeline) or a lone image.
        below = [s for s in (1, *config.split_sizes) if s < batch]
        below = [s for s in below if not _lone_image(w, h, batch, s)] or [batch]
        config = dataclasses.replace(config, split_size=max(below))
    if _lone_image(w, h, batch, config.split_size):
        raise UsageError(
            f"--batch-size {batch} with --image-size {w}x{h}: every split leaves a micro-batch "
            "of one image, which BatchNorm cannot train on at one pixel; give a larger batch "
            "or larger images"
        )
    return config


def _header(args: argparse.Namespace, dev0: torch.device, dev1: torch.device) -> None:
    print(
        f"mpstream {__version__} | torch {torch.__version__} | devices {dev0}, {dev1} "
        f"({device_name(dev0)}){' | quick' if args.quick else ''}",
        flush=True,
    )


def _bench(args: argparse.Namespace) -> int:
    if args.model == "transformer":
        return cli_transformer.run(args)
    given = cli_transformer.given(args, cli_transformer.TRANSFORMER_ONLY)
    if given:
        raise UsageError(f"{given}: options of --model transformer; give it too, or drop them")
    dev0, dev1 = _devices(args)
    config = _config(args)
    from ..tutorial import bench

    plots = extras.figures("bench", not args.no_plots)
    _header(args, dev0, dev1)
    sweep = not args.no_sweep
    total = bench.calls(config, sweep, bench.models_for(dev0, dev1))
    with extras.progress(total, "train", not args.no_progress) as bar:
        results = bench.run(
            config, dev0, dev1, sweep=sweep, tick=lambda: bar.update(1), status=bar.set_description
        )
    print(bench.table(results))
    for path in bench.save(results, Path(args.out), plots=plots):
        print(f"wrote {path}")
    return 0


def _balances(text: str | None) -> list[str | list[int]]:
    """``--balances`` read: 'tutorial', 'time' or layer counts, in order."""
    items: list[str | list[int]] = []
    for item in (t.strip() for t in (text or "").split(",") if t.strip()):
        if item in ("tutorial", "time"):
            items.append(item)
            continue
        parts = item.split(":")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise UsageError(f"--balances: {item!r} is not 'tutorial', 'time' or counts like 9:14")
        if sum(int(p) for p in parts) != 23:
            raise UsageError(f"--balances: {item} must add up to ResNet50's 23 blocks")
        items.append([int(p) for p in parts])
    return items


def _resolved(
    items: list[str | list[int]], dev0: torch.device, config: Config
) -> list[list[int]] | None:
    """The balances ``items`` name, 'time' profiled on ``dev0``."""
    from ..stages import balance_by_time
    from ..tutorial.analysis import TUTORIAL_SPLITS
    from ..tutorial.models import resnet50_layers

    out = []
    for item in items:
        if isinstance(item, list):
            out.append(item)
        elif item == "tutorial":
            out.append(TUTORIAL_SPLITS[2])
        else:  # "time"
            sample = torch.randn(config.split_size, 3, config.image_w, config.image_h)
            out.append(balance_by_time(resnet50_layers(), sample, 2, device=dev0))
    return out or None


def _tune(args: argparse.Namespace) -> int:
    dev0, dev1 = _devices(args)
    config = _config(args)
    items = _balances(args.balances)
    from ..observe import tuning
    from ..tutorial import analysis

    out = Path(args.out)
    plot = out / "tune_tradeoff.png" if extras.figures("tune", True) else None
    _header(args, dev0, dev1)
    balances = _resolved(items, dev0, config)
    x, y = analysis.batch(config, dev0)
    y = y.to(dev1)
    loss_fn = None if args.forward_only else (lambda out: torch.nn.functional.mse_loss(out, y))
    cache = None if args.no_cache else (args.cache or "default")
    out.mkdir(parents=True, exist_ok=True)
    factory = analysis.tutorial_factory(dev0, dev1, config)
    target = factory if balances else (lambda split: factory(split, None))
    result = tuning.tune(
        target,
        x,
        loss_fn,
        args.split_sizes,
        balances=balances,
        repeat=args.repeat or TUNE_REPEAT,
        warmup=config.warmup,
        patience=args.patience,
        cache=cache,
        refresh=args.refresh,
        progress=not args.no_progress,
        plot=plot,
    )
    for point in result.curve:
        balance = "" if point.balance is None else f"  balance {point.balance}"
        print(f"split {point.split_size:>4}: {point.median:.4f} s{balance}")
    source = " (from cache)" if result.cached else ""
    extra = f", balance {result.balance}" if result.balance else ""
    print(f"best: split size {result.split_size}{extra}, {result.best.median:.4f} s{source}")
    (out / "tune.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")
    for path in (out / "tune.json", plot):
        if path is not None:
            print(f"wrote {path}")
    return 0


def _trace(args: argparse.Namespace) -> int:
    dev0, dev1 = _devices(args)
    config = _config(args)
    from ..tutorial import analysis

    plot = extras.figures("trace", True)
    _header(args, dev0, dev1)
    out = Path(args.out)
    summary = analysis.trace_tutorial(dev0, dev1, config, out, plot=plot)
    print("trace of the tutorial run (measured):")
    for key in ("makespan_ms", "bubble_fraction", "copy_hidden_fraction", "stage_busy_ms"):
        print(f"  {key}: {summary[key]}")
    sizes = args.split_sizes or tuple(s for s in config.split_sizes if s <= config.batch_size)[:4]
    validation = analysis.validate_cost_model(dev0, dev1, config, sizes, repeat=config.repeat)
    print("cost model vs measured training steps:")
    for row in validation:
        print(
            f"  split {row['split_size']:>3}: measured {row['measured_ms']:9.2f} ms, "
            f"predicted {row['predicted_ms']:9.2f} ms, error {100 * row['error']:+.1f}%"
        )
    scaling = analysis.predict_scaling(dev0, config, link_gbps=args.link_gbps)
    print(
        f"predictions (cost model, not measured; layers profiled on {dev0}, "
        f"copies at an assumed {args.link_gbps} GB/s):"
    )
    for row in scaling["rows"]:
        print(
            f"  {row['devices']} devices, {row['split']:<14} {row['balance']}: "
            f"{row['predicted_step_ms']:9.2f} ms, speed-up {row['predicted_speedup']:.2f}x"
        )
    doc = {
        **metadata((dev0, dev1)),
        "config": dataclasses.asdict(config),
        "trace_summary": summary,
        "cost_model_validation": validation,
        "predictions": scaling,
    }
    (out / "trace_report.json").write_text(json.dumps(doc, indent=2) + "\n")
    for name in ("trace.json", "timeline.png" if plot else "", "trace_report.json"):
        if name:
            print(f"wrote {out / name}")
    return 0


# The ResNet experiment's defaults, in help texts: tutorial/design.py's FULL
# and QUICK hold them, and load torchvision, which help must not need
# (tests/cli/test_main.py checks the two agree).
REPEAT, QUICK_REPEAT, WARMUP = 10, 3, 1
TUNE_REPEAT = 3  # a tuning curve times many configurations: fewer runs each


def _size_options(
    p: argparse.ArgumentParser,
    main_split: str | None,
    repeat: str,
    warmup: str,
    batches: bool = True,
    progress: bool = True,
) -> None:
    """The ResNet experiment's options; ``main_split`` says what ``--split-size``
    sets (None: no such option), ``repeat`` and ``warmup`` their defaults."""
    p.add_argument("--devices", help="two devices, e.g. cuda:0,cuda:1 (default: detected)")
    p.add_argument("--quick", action="store_true", help="CPU-sized run")
    p.add_argument(
        "--repeat", type=positive_int, help=f"timed runs per configuration (default: {repeat})"
    )
    p.add_argument(
        "--warmup", type=non_negative_int, help=f"untimed runs before timing (default: {warmup})"
    )
    if main_split is not None:  # tune sweeps split sizes; it has no main one
        p.add_argument(
            "--split-size",
            type=positive_int,
            help=f"split size of {main_split} (default: 12, 4 with --quick; below the batch size)",
        )
    p.add_argument("--split-sizes", type=int_list, help="split sizes, e.g. 1,3,5,8,10,12,20,40,60")
    p.add_argument("--batch-size", type=positive_int, help="images per mini-batch")
    if batches:  # tune times one mini-batch per step
        p.add_argument("--num-batches", type=positive_int, help="mini-batches per train() call")
    p.add_argument(
        "--image-size",
        type=image_size,
        help="W or WxH (at least 32; at 32x32 every micro-batch needs 2 or more images)",
    )
    p.add_argument("--num-classes", type=positive_int, help="classes of the one-hot labels")
    if progress:  # trace shows none
        p.add_argument("--no-progress", action="store_true", help="no progress bar")


def parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mpstream`` command."""
    p = argparse.ArgumentParser(prog="mpstream", description="mpstream pipeline tools")
    p.add_argument("--version", action="version", version=f"mpstream {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    b = sub.add_parser(
        "bench",
        help="time the tutorial's ResNet50 experiment, or a transformer",
        description=(
            "Time the tutorial's training experiment for the single-device ResNet50, the "
            "tutorial's model-parallel and pipelined models and mpstream, sweep the split size "
            "for both pipelines, and save the tutorial's figures and a JSON of every measurement. "
            "With --model transformer: a Llama-style decoder trained by the single device, naive "
            "model parallel and mpstream's schedules over micro-batch counts."
        ),
    )
    b.add_argument(
        "--model",
        choices=("resnet50", "transformer"),
        default="resnet50",
        help="the tutorial's ResNet50 experiment, or the transformer workload (%(default)s)",
    )
    presets = ", ".join(f"{n} {p.repeat}" for n, p in PRESETS.items())
    warmups = ", ".join(f"{n} {p.warmup}" for n, p in PRESETS.items())
    _size_options(
        b,
        "the main comparison",
        f"{REPEAT}, {QUICK_REPEAT} with --quick; --model transformer: its preset's, {presets}",
        f"{WARMUP}; --model transformer: its preset's, {warmups}",
    )
    cli_transformer.add_options(b)
    b.add_argument("--out", default="mpstream-bench", help="output folder (default: %(default)s)")
    b.add_argument("--no-sweep", action="store_true", help="skip the split-size sweep")
    b.add_argument("--no-plots", action="store_true", help="write the JSON only")
    b.set_defaults(func=_bench)

    t = sub.add_parser(
        "tune",
        help="find the fastest split size (and balance) of the tutorial's ResNet50",
        description=(
            "Time a training step of the tutorial's ResNet50 as a two-stage mpstream Pipe at "
            "increasing split sizes (for each balance given), stop once times rise, print the "
            "best configuration, save the tradeoff curve and cache the result as JSON."
        ),
    )
    _size_options(t, None, str(TUNE_REPEAT), str(WARMUP), batches=False)
    t.add_argument(
        "--balances",
        help="stage balances to try over ResNet50's 23 blocks: 'tutorial', 'time' (profiled), "
        "or layer counts like 9:14; comma-separated (default: tutorial)",
    )
    t.add_argument(
        "--patience",
        type=positive_int,
        default=2,
        help="slower sizes in a row before stopping (default: %(default)s)",
    )
    t.add_argument("--forward-only", action="store_true", help="time the forward alone")
    t.add_argument("--cache", help="tuning cache JSON (default: ~/.cache/mpstream/tune.json)")
    t.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    t.add_argument("--refresh", action="store_true", help="measure even if cached")
    t.add_argument("--out", default="mpstream-tune", help="output folder (default: %(default)s)")
    t.set_defaults(func=_tune)

    r = sub.add_parser(
        "trace",
        help="trace the tutorial run and check the cost model",
        description=(
            "Profile the tutorial's training loop through mpstream (Chrome trace, timeline PNG, "
            "summary), fit the cost model to measured steps at several split sizes and report "
            "its error, and predict two- and four-device steps (labelled predictions)."
        ),
    )
    _size_options(
        r,
        "the traced run",
        f"{REPEAT}, {QUICK_REPEAT} with --quick: the cost model's measured steps",
        str(WARMUP),
        progress=False,
    )
    r.add_argument(
        "--link-gbps",
        type=positive_float,
        default=50.0,
        help="assumed copy bandwidth for predictions (default: %(default)s)",
    )
    r.add_argument("--out", default="mpstream-trace", help="output folder (default: %(default)s)")
    r.set_defaults(func=_trace)
    cli_doctor.add_command(sub)

    cli_schedules.add_command(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mpstream`` console script.

    Returns:
        The exit status: 0 on success, 2 on a bad option, 1 when a package
        the command needs is missing or a ``doctor`` step failed. An error
        while running propagates, with its traceback.
    """
    args = parser().parse_args(argv)
    args.command_line = shlex.join(["mpstream", *(sys.argv[1:] if argv is None else argv)])
    try:
        extras.require(args.command, NEEDS[args.command](args))
    except extras.MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 1
    created: list[Path] = []
    try:
        _check_paths(args, created)
        return int(args.func(args))
    except UsageError as exc:
        print(f"mpstream {args.command}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        for folder in created:  # a run that stopped early leaves no empty --out behind
            try:
                folder.rmdir()
            except OSError:  # not empty: what was written stays
                break


def _check_paths(args: argparse.Namespace, created: list[Path]) -> None:
    """Creates ``--out`` and checks ``--cache`` before anything is measured:
    a run must not end, its results lost, on a folder it cannot write.

    Args:
        args: the parsed options.
        created: filled with the folders created for ``--out``, deepest first.

    Raises:
        UsageError: naming the option and why.
    """
    out = getattr(args, "out", None)
    if out is not None:
        path = Path(out)
        created += [p for p in (path, *path.parents) if not p.exists()]
        _writable_folder(path, f"--out {out}", "the folder")
    cache = getattr(args, "cache", None)
    if cache is not None and not getattr(args, "no_cache", False):
        if Path(cache).is_dir():
            raise UsageError(f"--cache {cache}: is a folder; give a JSON file's path")
        folder = Path(cache).parent
        _writable_folder(folder, f"--cache {cache}", str(folder))


def _writable_folder(folder: Path, option: str, name: str) -> None:
    """Makes ``folder`` (and its parents) exist; errors name the ``option``
    and the folder as ``name``.

    Raises:
        UsageError: it cannot be created, or is not writable.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{option}: cannot create {name} ({exc.strerror or exc})") from None
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{option}: {name} is not writable")

"""The ``mpstream`` command line (also ``python -m mpstream``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from . import __version__, bench

__all__ = ["main", "parser"]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected comma-separated sizes, e.g. 1,3,12")
    return tuple(positive_int(p) for p in parts)


def image_size(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) == 1:
        side = positive_int(parts[0])
        return side, side
    if len(parts) == 2:
        return positive_int(parts[0]), positive_int(parts[1])
    raise argparse.ArgumentTypeError(f"expected W or WxH, got {text!r}")


def _config(args: argparse.Namespace) -> bench.Config:
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
        value = getattr(args, name)
        if value is not None:
            changes[name] = value
    if args.image_size is not None:
        changes["image_w"], changes["image_h"] = args.image_size
    return dataclasses.replace(config, **changes)  # type: ignore[arg-type]


def _bench(args: argparse.Namespace) -> int:
    dev0, dev1 = bench.detect_devices(args.devices)
    config = _config(args)
    if config.image_w < 32 or config.image_h < 32:
        raise ValueError("--image-size must be at least 32x32 (ResNet50 downsamples 32x)")
    out = Path(args.out)
    print(
        f"mpstream {__version__} | torch {torch.__version__} | devices {dev0}, {dev1} "
        f"({bench.device_name(dev0)}){' | quick' if args.quick else ''}",
        flush=True,
    )
    from tqdm import tqdm

    sweep = not args.no_sweep
    with tqdm(total=bench.calls(config, sweep), unit="train", disable=args.no_progress) as bar:
        results = bench.run(
            config,
            dev0,
            dev1,
            sweep=sweep,
            tick=lambda: bar.update(1),
            status=bar.set_description,
        )
    print(bench.table(results))
    for path in bench.save(results, out, plots=not args.no_plots):
        print(f"wrote {path}")
    return 0


def parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mpstream`` command."""
    p = argparse.ArgumentParser(prog="mpstream", description="mpstream pipeline tools")
    p.add_argument("--version", action="version", version=f"mpstream {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    b = sub.add_parser(
        "bench",
        help="time the tutorial's ResNet50 experiment",
        description=(
            "Time the tutorial's training experiment for the single-device ResNet50, the "
            "tutorial's model-parallel and pipelined models and mpstream, sweep the split size "
            "for both pipelines, and save the tutorial's figures and a JSON of every measurement."
        ),
    )
    b.add_argument("--devices", help="two devices, e.g. cuda:0,cuda:1 (default: detected)")
    b.add_argument("--quick", action="store_true", help="CPU-sized run (about a minute)")
    b.add_argument("--repeat", type=positive_int, help="timed train() calls per configuration")
    b.add_argument("--warmup", type=non_negative_int, help="untimed calls before timing")
    b.add_argument("--split-size", type=positive_int, help="split size of the main comparison")
    b.add_argument("--split-sizes", type=int_list, help="sweep, e.g. 1,3,5,8,10,12,20,40,60")
    b.add_argument("--batch-size", type=positive_int, help="images per mini-batch")
    b.add_argument("--num-batches", type=positive_int, help="mini-batches per train() call")
    b.add_argument("--image-size", type=image_size, help="W or WxH (at least 32)")
    b.add_argument("--num-classes", type=positive_int, help="classes of the one-hot labels")
    b.add_argument("--out", default="mpstream-bench", help="output folder (default: %(default)s)")
    b.add_argument("--no-sweep", action="store_true", help="skip the split-size sweep")
    b.add_argument("--no-plots", action="store_true", help="write the JSON only")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(func=_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mpstream`` console script.

    Returns:
        The exit status: 0 on success, 2 on a bad option.
    """
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as exc:
        print(f"mpstream {args.command}: error: {exc}", file=sys.stderr)
        return 2

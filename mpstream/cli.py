"""The ``mpstream`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from . import __version__, bench

__all__ = ["main"]


def _bench(args: argparse.Namespace) -> int:
    dev0, dev1 = bench.detect_devices(args.devices)
    quick = args.quick
    config = bench.QUICK if quick else bench.FULL
    print(
        f"mpstream {__version__}, torch {torch.__version__}, devices {dev0} / {dev1}"
        f"{' (quick)' if quick else ''}",
        flush=True,
    )
    results = bench.experiment(
        config, dev0, dev1, progress=lambda n: print(f"  timing {n} ...", flush=True)
    )
    print(bench.table(results))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mpstream", description="mpstream pipeline tools")
    p.add_argument("--version", action="version", version=f"mpstream {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="time the tutorial's experiment")
    b.add_argument("--devices", help="two devices, e.g. cuda:0,cuda:1 (default: detected)")
    b.add_argument("--quick", action="store_true", help="CPU-sized run")
    b.set_defaults(func=_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mpstream`` console script."""
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as exc:
        print(f"mpstream: error: {exc}", file=sys.stderr)
        return 2

"""The ``mpstream`` command line (also ``python -m mpstream``).

Each command first says what it lacks of the optional extras
(:mod:`.extras`), then checks its options: a bad one exits 2 with argparse's
one-line error (:class:`.argtypes.UsageError`), before anything is measured.
An error while running is no bad option: it keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .._version import __version__
from ..workloads.transformer import PRESETS
from . import doctor as cli_doctor
from . import extras
from . import resnet as cli_resnet
from . import schedules as cli_schedules
from . import transformer as cli_transformer
from .argtypes import (
    UsageError,
    device_here,
    image_size,
    int_list,
    non_negative_int,
    positive_float,
    positive_int,
)
from .output import reader_may_leave

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


# The ResNet experiment's defaults, in help texts: tutorial/design.py's FULL
# and QUICK hold them, and load torchvision, which help must not need
# (tests/cli/test_args.py checks the two agree).
REPEAT, QUICK_REPEAT, WARMUP = 10, 3, 1
BATCH, QUICK_BATCH, BATCHES, QUICK_BATCHES = 120, 16, 3, 2
IMAGE, QUICK_IMAGE, CLASSES = 128, 64, 1000
SWEEP, QUICK_SWEEP = (1, 3, 5, 8, 10, 12, 20, 40, 60), (2, 4, 8, 16)


def _listed(sizes: tuple[int, ...]) -> str:
    return ",".join(map(str, sizes))


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
    p.add_argument(
        "--devices", help="one or two devices, e.g. cuda:0 or cuda:0,cuda:1 (default: detected)"
    )
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
    p.add_argument(
        "--split-sizes",
        type=int_list,
        help=f"split sizes (default: {_listed(SWEEP)}, or {_listed(QUICK_SWEEP)} with --quick, "
        f"up to the batch size)",
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        help=f"images per mini-batch (default: {BATCH}, {QUICK_BATCH} with --quick)",
    )
    if batches:  # tune times one mini-batch per step
        p.add_argument(
            "--num-batches",
            type=positive_int,
            help=f"mini-batches per train() call (default: {BATCHES}, {QUICK_BATCHES} with "
            f"--quick)",
        )
    p.add_argument(
        "--image-size",
        type=image_size,
        help=f"W or WxH (default: {IMAGE}, {QUICK_IMAGE} with --quick; at least 32; at 32x32 "
        f"every micro-batch needs 2 or more images)",
    )
    p.add_argument(
        "--num-classes",
        type=positive_int,
        help=f"classes of the one-hot labels (default: {CLASSES})",
    )
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
    b.add_argument(
        "--no-plots",
        action="store_true",
        help="write the JSON only (removes an earlier run's figures)",
    )
    b.set_defaults(func=cli_resnet.bench)

    t = sub.add_parser(
        "tune",
        help="find the fastest split size (and balance) of the tutorial's ResNet50",
        description=(
            "Time a training step of the tutorial's ResNet50 as a two-stage mpstream Pipe at "
            "increasing split sizes (for each balance given), stop once times rise, print the "
            "best configuration, save the tradeoff curve and cache the result as JSON."
        ),
    )
    _size_options(t, None, str(cli_resnet.TUNE_REPEAT), str(WARMUP), batches=False)
    t.add_argument(
        "--balances",
        help=f"stage balances to try over ResNet50's {cli_resnet.RESNET50_LAYERS} blocks: "
        "'tutorial', 'time' (profiled), "
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
    t.set_defaults(func=cli_resnet.tune)

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
        # Read as gigabytes, not the gigabits the flag's name suggests.
        help="assumed copy bandwidth for predictions, in GB/s (gigabytes per second; "
        "default: %(default)s)",
    )
    r.add_argument(
        "--input-device",
        type=device_here,
        help="where the batch sits for the predictions, as predict(input_device=) takes it "
        "(default: the first stage's device; another, e.g. cpu: each micro-batch's images "
        "copied in at --link-gbps)",
    )
    r.add_argument(
        "--order",
        metavar="FILE",
        help="a text file holding your order of actions for the tutorial's 2 stages and the "
        "micro-batches --batch-size makes at --split-size (F0m0 F1m0 B1m0 B0m0 for one): "
        "the traced steps and the cost model's are train_step in that order, at --split-size "
        "alone, the stages on --devices' two devices (one device twice for an order of both "
        "on one)",
    )
    r.add_argument("--out", default="mpstream-trace", help="output folder (default: %(default)s)")
    r.set_defaults(func=cli_resnet.trace)
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
    # `mpstream schedules | head` still writes its files; under 2>&1, a
    # refusal after the reader left still exits 2.
    try:
        with reader_may_leave():
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
    a run must not end, its results lost, on a folder it cannot write, nor
    ignore ``--cache`` or ``--refresh`` given with ``--no-cache``, nor
    (tune) write its ``tune.json`` over the tuning cache.

    Args:
        args: the parsed options.
        created: filled with the folders created for ``--out``, deepest first.

    Raises:
        UsageError: naming the option and why.
    """
    out = getattr(args, "out", None)
    if args.command == "tune" and out is not None:
        _out_is_not_the_cache(Path(out), getattr(args, "cache", None))
    if out is not None:
        path = Path(out)
        created += [p for p in (path, *path.parents) if not p.exists()]
        _writable_folder(path, f"--out {out}", "the folder")
    cache = getattr(args, "cache", None)
    if getattr(args, "no_cache", False):
        given = [o for o, v in (("--cache", cache), ("--refresh", args.refresh)) if v]
        if given:
            # Each asks for a cache --no-cache says not to touch.
            raise UsageError(
                f"--no-cache neither reads nor writes the cache, so {' and '.join(given)} "
                f"would be ignored: drop one or the other"
            )
    elif cache is not None:
        if Path(cache).is_dir():
            raise UsageError(f"--cache {cache}: is a folder; give a JSON file's path")
        folder = Path(cache).parent
        _writable_folder(folder, f"--cache {cache}", str(folder))


def _out_is_not_the_cache(out: Path, cache: str | None) -> None:
    """Refuses a ``tune --out`` whose ``tune.json`` is the tuning cache's
    file (the default one or ``--cache``'s): the run would replace the cache,
    every result stored in it, by its own curve.

    Raises:
        UsageError: naming the cache's folder.
    """
    from ..observe.tune_cache import default_cache

    written = (out / "tune.json").resolve()
    # The default cache too under --no-cache: it is the user's all the same.
    for path in (default_cache(), *([Path(cache)] if cache else [])):
        if written == path.resolve():
            raise UsageError(
                f"--out {out}: is the tuning cache's folder ({path.parent}), whose "
                f"{path.name} the run's tune.json would replace: pick another folder"
            )


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

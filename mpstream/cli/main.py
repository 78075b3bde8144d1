"""The ``mpstream`` command line (also ``python -m mpstream``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from .._version import __version__
from ..tutorial import bench
from . import schedules as cli_schedules
from . import transformer as cli_transformer
from .argtypes import image_size, int_list, non_negative_int, positive_float, positive_int

__all__ = ["main", "parser"]


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
        value = getattr(args, name, None)
        if value is not None:
            changes[name] = value
    if args.image_size is not None:
        changes["image_w"], changes["image_h"] = args.image_size
    config = dataclasses.replace(config, **changes)  # type: ignore[arg-type]
    if config.image_w < 32 or config.image_h < 32:
        raise ValueError("--image-size must be at least 32x32 (ResNet50 downsamples 32x)")
    batch = config.batch_size
    main = getattr(args, "split_size", None)  # tune has no main comparison
    given = [] if main is None else [main]
    over = [s for s in (*given, *(args.split_sizes or ())) if s > batch]
    if over:
        flag = "--split-size" if over[0] in given else "--split-sizes"
        raise ValueError(
            f"{flag} {over[0]}: larger than the batch of {batch} images (--batch-size)"
        )
    if args.split_sizes is None:  # the default sweep, up to the batch
        kept = tuple(s for s in config.split_sizes if s <= batch) or (batch,)
        config = dataclasses.replace(config, split_sizes=kept)
    if main is None and config.split_size >= batch > 1:
        # The default main split would leave one micro-batch: no pipeline.
        below = [s for s in (1, *config.split_sizes) if s < batch]
        config = dataclasses.replace(config, split_size=max(below))
    return config


def _header(args: argparse.Namespace, dev0: torch.device, dev1: torch.device) -> None:
    print(
        f"mpstream {__version__} | torch {torch.__version__} | devices {dev0}, {dev1} "
        f"({bench.device_name(dev0)}){' | quick' if args.quick else ''}",
        flush=True,
    )


def _bench(args: argparse.Namespace) -> int:
    if args.model == "transformer":
        return cli_transformer.run(args)
    dev0, dev1 = bench.detect_devices(args.devices)
    config = _config(args)
    _header(args, dev0, dev1)
    from tqdm import tqdm

    sweep = not args.no_sweep
    total = bench.calls(config, sweep, bench.models_for(dev0, dev1))
    # disable=None: a bar only on a terminal; in a log file it would be one long line.
    with tqdm(total=total, unit="train", disable=True if args.no_progress else None) as bar:
        results = bench.run(
            config, dev0, dev1, sweep=sweep, tick=lambda: bar.update(1), status=bar.set_description
        )
    print(bench.table(results))
    for path in bench.save(results, Path(args.out), plots=not args.no_plots):
        print(f"wrote {path}")
    return 0


def _balances(text: str | None, dev0: torch.device, config: bench.Config) -> list[list[int]] | None:
    if text is None:
        return None
    from ..stages import balance_by_time
    from ..tutorial.analysis import TUTORIAL_SPLITS
    from ..tutorial.models import resnet50_layers

    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item == "tutorial":
            out.append(TUTORIAL_SPLITS[2])
        elif item == "time":
            sample = torch.randn(config.split_size, 3, config.image_w, config.image_h)
            out.append(balance_by_time(resnet50_layers(), sample, 2, device=dev0))
        else:
            parts = item.split(":")
            if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise ValueError(
                    f"--balances: {item!r} is not 'tutorial', 'time' or counts like 9:14"
                )
            if sum(int(p) for p in parts) != 23:
                raise ValueError(f"--balances: {item} must add up to ResNet50's 23 blocks")
            out.append([int(p) for p in parts])
    return out or None


def _tune(args: argparse.Namespace) -> int:
    from ..observe import tuning
    from ..tutorial import analysis

    dev0, dev1 = bench.detect_devices(args.devices)
    config = _config(args)
    _header(args, dev0, dev1)
    balances = _balances(args.balances, dev0, config)
    x, y = analysis.batch(config, dev0)
    y = y.to(dev1)
    loss_fn = None if args.forward_only else (lambda out: torch.nn.functional.mse_loss(out, y))
    cache = None if args.no_cache else (args.cache or "default")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    factory = analysis.tutorial_factory(dev0, dev1, config)
    target = factory if balances else (lambda split: factory(split, None))
    result = tuning.tune(
        target,
        x,
        loss_fn,
        args.split_sizes,
        balances=balances,
        repeat=args.repeat or 3,
        warmup=config.warmup,
        patience=args.patience,
        cache=cache,
        refresh=args.refresh,
        progress=not args.no_progress,
        plot=out / "tune_tradeoff.png",
    )
    for point in result.curve:
        balance = "" if point.balance is None else f"  balance {point.balance}"
        print(f"split {point.split_size:>4}: {point.median:.4f} s{balance}")
    source = " (from cache)" if result.cached else ""
    extra = f", balance {result.balance}" if result.balance else ""
    print(f"best: split size {result.split_size}{extra}, {result.best.median:.4f} s{source}")
    (out / "tune.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")
    print(f"wrote {out / 'tune.json'}\nwrote {out / 'tune_tradeoff.png'}")
    return 0


def _trace(args: argparse.Namespace) -> int:
    from ..tutorial import analysis

    dev0, dev1 = bench.detect_devices(args.devices)
    config = _config(args)
    _header(args, dev0, dev1)
    out = Path(args.out)
    summary = analysis.trace_tutorial(dev0, dev1, config, out)
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
        **bench.metadata((dev0, dev1)),
        "config": dataclasses.asdict(config),
        "trace_summary": summary,
        "cost_model_validation": validation,
        "predictions": scaling,
    }
    (out / "trace_report.json").write_text(json.dumps(doc, indent=2) + "\n")
    for name in ("trace.json", "timeline.png", "trace_report.json"):
        print(f"wrote {out / name}")
    return 0


def _size_options(p: argparse.ArgumentParser, batches: bool = True, progress: bool = True) -> None:
    p.add_argument("--devices", help="two devices, e.g. cuda:0,cuda:1 (default: detected)")
    p.add_argument("--quick", action="store_true", help="CPU-sized run")
    p.add_argument("--repeat", type=positive_int, help="timed runs per configuration")
    p.add_argument("--warmup", type=non_negative_int, help="untimed runs before timing")
    if batches:  # tune sweeps split sizes; it has no main one
        p.add_argument(
            "--split-size",
            type=positive_int,
            help="split size of the main comparison (default: 12, 4 with --quick; below the "
            "batch size)",
        )
    p.add_argument("--split-sizes", type=int_list, help="split sizes, e.g. 1,3,5,8,10,12,20,40,60")
    p.add_argument("--batch-size", type=positive_int, help="images per mini-batch")
    if batches:  # tune times one mini-batch per step
        p.add_argument("--num-batches", type=positive_int, help="mini-batches per train() call")
    p.add_argument("--image-size", type=image_size, help="W or WxH (at least 32)")
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
    _size_options(b)
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
    _size_options(t, batches=False)
    t.add_argument(
        "--balances",
        help="stage balances to try over ResNet50's 23 blocks: 'tutorial', 'time' (profiled), "
        "or layer counts like 9:14; comma-separated (default: tutorial)",
    )
    t.add_argument("--patience", type=positive_int, default=2, help="slower sizes before stopping")
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
    _size_options(r, progress=False)
    r.add_argument(
        "--link-gbps",
        type=positive_float,
        default=50.0,
        help="assumed copy bandwidth for predictions",
    )
    r.add_argument("--out", default="mpstream-trace", help="output folder (default: %(default)s)")
    r.set_defaults(func=_trace)
    from . import doctor  # imports every doctor step: only when the parser is built

    doctor.add_command(sub)

    cli_schedules.add_command(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mpstream`` console script.

    Returns:
        The exit status: 0 on success, 2 on a bad option, 1 when a
        ``doctor`` step failed.
    """
    args = parser().parse_args(argv)
    args.command_line = shlex.join(["mpstream", *(sys.argv[1:] if argv is None else argv)])
    created: list[Path] = []
    try:
        _check_paths(args, created)
        return int(args.func(args))
    except ValueError as exc:
        print(f"mpstream {args.command}: error: {exc}", file=sys.stderr)
        for folder in created:  # a bad option leaves no empty --out behind
            try:
                folder.rmdir()
            except OSError:
                break
        return 2


def _check_paths(args: argparse.Namespace, created: list[Path]) -> None:
    """Creates ``--out`` and checks ``--cache`` before anything is measured:
    a run must not end, its results lost, on a folder it cannot write.

    Args:
        args: the parsed options.
        created: filled with the folders created for ``--out``, deepest first.

    Raises:
        ValueError: naming the option and why.
    """
    out = getattr(args, "out", None)
    if out is not None:
        path = Path(out)
        created += [p for p in (path, *path.parents) if not p.exists()]
        _writable_folder(path, f"--out {out}", "the folder")
    cache = getattr(args, "cache", None)
    if cache is not None and not getattr(args, "no_cache", False):
        if Path(cache).is_dir():
            raise ValueError(f"--cache {cache}: is a folder; give a JSON file's path")
        folder = Path(cache).parent
        _writable_folder(folder, f"--cache {cache}", str(folder))


def _writable_folder(folder: Path, option: str, name: str) -> None:
    """Makes ``folder`` (and its parents) exist; errors name the ``option``
    and the folder as ``name``.

    Raises:
        ValueError: it cannot be created, or is not writable.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{option}: cannot create {name} ({exc.strerror or exc})") from None
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{option}: {name} is not writable")

"""The ResNet experiment's commands: ``bench`` (the tutorial's models
side by side; ``--model transformer`` hands over to :mod:`.transformer`),
``tune`` (the split-size curve) and ``trace`` (one traced run, the cost
model against it, and its predictions).

Each reads the experiment's options into a :class:`~mpstream.tutorial.bench.Config`
(:func:`_config`, which refuses sizes ResNet50 cannot train on) and imports
the experiment's modules, which need torchvision, only when it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._version import __version__
from ..tutorial.machine import detect_devices, metadata, named_devices
from . import extras, orders
from . import transformer as cli_transformer
from .argtypes import UsageError
from .signals import finish, terminate_as_interrupt

if TYPE_CHECKING:  # the ResNet experiment's modules need torchvision: imported in the commands
    from ..tutorial.bench import Config

__all__ = [
    "bench",
    "tune",
    "trace",
    "summary_lines",
    "lone_image",
    "TUNE_REPEAT",
    "RESNET50_LAYERS",
]

#: A tuning curve times many configurations: fewer runs each.
TUNE_REPEAT = 3
#: The blocks of ``resnet50_layers()``, which a balance cuts (written out:
#: help and option checks load no torchvision).
RESNET50_LAYERS = 23


def _devices(args: argparse.Namespace) -> tuple[torch.device, torch.device]:
    try:
        return detect_devices(args.devices)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def lone_image(width: int, height: int, batch: int, split: int) -> bool:
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
    if args.split_sizes is not None:  # the sweep's curve and table run in increasing order
        changes["split_sizes"] = tuple(sorted(args.split_sizes))  # each once (int_list)
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
    lone = [s for s in (*given, *(args.split_sizes or ())) if lone_image(w, h, batch, s)]
    if lone:
        flag = "--split-size" if lone[0] in given else "--split-sizes"
        what = "--batch-size 1" if batch == 1 else f"{flag} {lone[0]}"
        raise UsageError(
            f"{what} with --image-size {w}x{h}: a micro-batch of one image, which ResNet50 "
            "brings down to one pixel, and BatchNorm cannot train on one value per channel; "
            "use micro-batches of 2 or more images, or images larger than 32x32"
        )
    if args.split_sizes is None:  # the default sweep, up to the batch
        kept = tuple(s for s in config.split_sizes if s <= batch and not lone_image(w, h, batch, s))
        config = dataclasses.replace(config, split_sizes=kept or (batch,))
    default = config.split_size
    if main is None and (default >= batch or lone_image(w, h, batch, default)):
        # The default main split would leave one micro-batch (no pipeline) or a lone image;
        # with a batch of one image the split used, and labelled, is 1.
        below = [s for s in (1, *config.split_sizes) if s < batch]
        below = [s for s in below if not lone_image(w, h, batch, s)] or [batch]
        config = dataclasses.replace(config, split_size=max(below))
    if lone_image(w, h, batch, config.split_size):
        raise UsageError(
            f"--batch-size {batch} with --image-size {w}x{h}: every split leaves a micro-batch "
            "of one image, which BatchNorm cannot train on at one pixel; give a larger batch "
            "or larger images"
        )
    return config


def _header(args: argparse.Namespace, dev0: torch.device, dev1: torch.device) -> None:
    print(
        f"mpstream {__version__} | torch {torch.__version__} | devices "
        f"{named_devices((dev0, dev1))}{' | quick' if args.quick else ''}",
        flush=True,
    )


def bench(args: argparse.Namespace) -> int:
    if args.model == "transformer":
        return cli_transformer.run(args)
    given = cli_transformer.given(args, cli_transformer.TRANSFORMER_ONLY)
    if given:
        raise UsageError(f"{given}: options of --model transformer; give it too, or drop them")
    if args.no_sweep and args.split_sizes is not None:  # else silently unused
        raise UsageError(
            "--split-sizes: the sizes the sweep times, but --no-sweep skips the sweep; drop "
            "one (--split-size sets the main comparison's)"
        )
    dev0, dev1 = _devices(args)
    config = _config(args)
    from ..tutorial import bench

    plots = extras.figures("bench", not args.no_plots)
    _header(args, dev0, dev1)
    sweep = not args.no_sweep
    total = bench.calls(config, sweep, bench.models_for(dev0, dev1))
    with (
        extras.progress(total, "train", not args.no_progress) as bar,
        terminate_as_interrupt(lambda: bar.update(1)) as tick,
    ):
        results = bench.run(
            config, dev0, dev1, sweep=sweep, tick=tick, status=bar.set_description,
            interruptible=True,
        )  # fmt: skip
    return finish(results, bench.table, bench.save, Path(args.out), plots)


def _balances(text: str | None) -> list[str | list[int]]:
    """``--balances`` read: 'tutorial', 'time' or layer counts, in order."""
    items: list[str | list[int]] = []
    given = [t.strip() for t in (text or "").split(",") if t.strip()]
    repeated = list(dict.fromkeys(t for t in given if given.count(t) > 1))
    if repeated:  # tune would time it once, unsaid
        raise UsageError(f"--balances: {', '.join(repeated)} given more than once: give each once")
    for item in given:
        if item in ("tutorial", "time"):
            items.append(item)
            continue
        parts = item.split(":")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise UsageError(f"--balances: {item!r} is not 'tutorial', 'time' or counts like 9:14")
        if sum(int(p) for p in parts) != RESNET50_LAYERS:
            raise UsageError(
                f"--balances: {item} must add up to ResNet50's {RESNET50_LAYERS} blocks"
            )
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


def tune(args: argparse.Namespace) -> int:
    dev0, dev1 = _devices(args)
    config = _config(args)
    items = _balances(args.balances)
    from ..observe import tune_args, tuning
    from ..tutorial import analysis

    out = Path(args.out)
    plot = out / "tune_tradeoff.png" if extras.figures("tune", True) else None
    _header(args, dev0, dev1)
    balances = _resolved(items, dev0, config)
    x, y = analysis.batch(config, dev0)
    y = y.to(dev1)
    loss_fn = None if args.forward_only else (lambda out: torch.nn.functional.mse_loss(out, y))
    cache = None if args.no_cache else (args.cache or "default")
    sizes = args.split_sizes
    if sizes is None:  # tuning's ladder, less the lone images _config refuses when given
        w, h, batch = config.image_w, config.image_h, config.batch_size
        ladder = tune_args.candidate_split_sizes(batch)
        sizes = tuple(s for s in ladder if not lone_image(w, h, batch, s))
    out.mkdir(parents=True, exist_ok=True)
    factory = analysis.tutorial_factory(dev0, dev1, config)
    target = factory if balances else (lambda split: factory(split, None))
    result = tuning.tune(
        target,
        x,
        loss_fn,
        sizes,
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
    stops = result.stops()  # tune.json's "stopped_early", said where and why
    if stops:
        print(stops)
    # Said in the file as on the line above: cached times may be another run's.
    doc = {**result.to_json(), "from_cache": result.cached}
    (out / "tune.json").write_text(json.dumps(doc, indent=2) + "\n")
    for path in (out / "tune.json", plot):
        if path is not None:
            print(f"wrote {path}")
    return 0


def _order(args: argparse.Namespace, config: Config) -> tuple[str, ...] | None:
    """``trace --order``: the order read and checked against the tutorial's
    two stages and the micro-batches of the traced run."""
    if args.order is None:
        return None
    order = orders.read(args.order)
    if args.split_sizes is not None:
        raise UsageError(
            "--split-sizes with --order: an order covers one micro-batch count, so the cost "
            "model is checked at --split-size alone; drop --split-sizes"
        )
    batch, split = config.batch_size, config.split_size
    micros = -(-batch // split)
    orders.checked(
        order,
        args.order,
        (2, "the tutorial's model has 2 stages: give an order for 2"),
        (
            micros,
            f"--batch-size {batch} in micro-batches of {split} (--split-size) makes {micros}: "
            f"give an order for {micros}, or a --split-size making as many as the order covers",
        ),
    )
    return order


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The traced run's summary as ``trace`` prints it: ``key: value``
    lines, the keys and values of ``trace_report.json``'s ``trace_summary``.

    Args:
        summary: the traced run's :meth:`~mpstream.observe.summary.Summary.to_dict`.

    Returns:
        The lines, without indentation.
    """
    # bubble_fraction counts a stage idle while another stage on its device
    # computes: on the CPU (one device) it reads 50% with the device never
    # idle. Where stages shared a device, the device's idle share follows it.
    lines = [f"{key}: {summary[key]}" for key in ("makespan_ms", "bubble_fraction")]
    stages, devices = len(summary["stage_busy_ms"]), summary.get("devices", 0)
    if 0 < devices < stages:
        plural = "" if devices == 1 else "s"
        lines.append(
            f"device_idle_fraction: {summary['device_idle_fraction']}  "
            f"({stages} stages on {devices} device{plural})"
        )
    lines += [f"{key}: {summary[key]}" for key in ("copy_hidden_fraction", "stage_busy_ms")]
    return lines


def trace(args: argparse.Namespace) -> int:
    dev0, dev1 = _devices(args)
    config = _config(args)
    order = _order(args, config)
    from ..tutorial import analysis

    plot = extras.figures("trace", True)
    _header(args, dev0, dev1)
    out = Path(args.out)
    summary = analysis.trace_tutorial(dev0, dev1, config, out, plot=plot, order=order)
    what = "the tutorial run" if order is None else f"train_step in your order ({args.order})"
    print(f"trace of {what} (measured):")
    for line in summary_lines(summary):
        print(f"  {line}")
    if order is not None:
        sizes: tuple[int, ...] = (config.split_size,)
    else:
        sizes = config.split_sizes if args.split_sizes else config.split_sizes[:4]
    validation = analysis.validate_cost_model(
        dev0, dev1, config, sizes, repeat=config.repeat, order=order
    )
    print("cost model vs measured training steps:")
    for row in validation:
        print(
            f"  split {row['split_size']:>3}: measured {row['measured_ms']:9.2f} ms, "
            f"predicted {row['predicted_ms']:9.2f} ms, error {100 * row['error']:+.1f}%"
        )
    source = None if args.input_device is None else torch.device(args.input_device)
    scaling = analysis.predict_scaling(dev0, config, link_gbps=args.link_gbps, input_device=source)
    # More devices need another order than the one given: they run fill-drain.
    schedule = "" if order is None else "fill-drain, not your order; "
    batch = (
        f"; the batch on {source}, each micro-batch's images copied in "
        f"({scaling['input_copy_ms']:.3f} ms)"
        if scaling["input_copy_ms"] is not None
        else ""
    )
    print(
        f"predictions (cost model, not measured; {schedule}layers profiled on {dev0}, "
        f"copies at an assumed {args.link_gbps} GB/s{batch}):"
    )
    for row in scaling["rows"]:
        print(
            f"  {row['devices']} devices, {row['split']:<14} {row['balance']}: "
            f"{row['predicted_step_ms']:9.2f} ms, speed-up {row['predicted_speedup']:.2f}x"
        )
    doc = {
        **metadata((dev0, dev1)),
        "config": dataclasses.asdict(config),
        "order": None if order is None else " ".join(order),
        "trace_summary": summary,
        "cost_model_validation": validation,
        "predictions": scaling,
    }
    (out / "trace_report.json").write_text(json.dumps(doc, indent=2) + "\n")
    for name in ("trace.json", "timeline.png" if plot else "", "trace_report.json"):
        if name:
            print(f"wrote {out / name}")
    return 0

"""``mpstream schedules``: every schedule simulated side by side, with measured memory."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .._words import count_of
from ..observe.cost_model import Cost
from ..schedules import SCHEDULES, Order
from ..tutorial.machine import detect_devices, device_name, metadata
from . import extras, orders
from .argtypes import UsageError, device_here, non_negative_float, positive_int
from .resnet import RESNET50_LAYERS

__all__ = ["add_command", "run"]

BALANCES = ("tutorial", "time")
SPLIT_SIZE, IMAGE_SIZE, DEVICES, STAGES, MICROS = 2, 64, 2, 4, 8
# What only a profiled ResNet50 uses, which --uniform replaces.
PROFILE_OPTIONS = ("device", "balance", "split_size", "image_size", "no_memory")


def deprecated_device_count(text: str) -> int:
    """``--devices``, the old spelling of ``--num-devices``: a count still
    works; device names (what the other commands' ``--devices`` take) are
    pointed to ``--num-devices`` and ``--device``."""
    try:
        int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected how many devices to simulate, got {text!r}; this count is "
            "--num-devices now (e.g. --num-devices 2), and the device to profile and measure "
            "on is --device (e.g. --device cuda:0)"
        ) from None
    return positive_int(text)


class DeprecatedDevices(argparse.Action):
    """``--devices N``: stores the count and says once, on stderr, that the
    option is ``--num-devices`` now (kept for one release)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: warning: --devices is deprecated and goes in the next release; "
            f"use --num-devices {values}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the ``schedules`` command to the ``mpstream`` parser."""
    c = sub.add_parser(
        "schedules",
        help="compare pipeline schedules side by side",
        description=(
            "Simulate every built-in schedule (gpipe, 1f1b, interleaved_1f1b, zb_h1, "
            "looped_bfs, interleaved_zb, zbv, dualpipev; those whose placement the stages and "
            "devices allow) for the given "
            "stages, devices and micro-batches from a measured profile of the tutorial's "
            "ResNet50 (or unit costs), print step time, device idle share and live "
            "activations per stage, measure each schedule's peak memory in a real step, and "
            "draw one PNG with a "
            "timeline per schedule on one time axis. With --order, your order of actions "
            "beside them."
        ),
    )
    c.add_argument(
        "--stages",
        type=positive_int,
        help=f"pipeline stages (default {STAGES}, or those --order names; at most "
        f"{RESNET50_LAYERS}, ResNet50's blocks, without --uniform)",
    )
    c.add_argument(
        "--num-devices",
        type=positive_int,
        help=f"how many devices the simulated stages share (default {DEVICES}); the "
        "simulation needs no such devices here (--device is where to measure)",
    )
    # The old spelling, hidden; the other commands' --devices take names.
    c.add_argument(
        "--devices",
        dest="old_devices",
        type=deprecated_device_count,
        action=DeprecatedDevices,
        help=argparse.SUPPRESS,
    )
    c.add_argument(
        "--micro-batches",
        type=positive_int,
        help=f"micro-batches per step (default {MICROS}, or those --order covers)",
    )
    c.add_argument(
        "--order",
        metavar="FILE",
        help="a text file holding your order of actions (e.g. F0m0 F1m0 B1m0 B0m0, as "
        "Pipe(schedule=...) takes it): simulated, measured and drawn as 'your order', its "
        "stages placed on the devices as --order-placement says",
    )
    c.add_argument(
        "--order-placement",
        choices=orders.PLACEMENT_CHOICES,
        help="how --order's stages sit on the devices, as the built-in schedules of that "
        "placement place theirs: stage (default: contiguous runs, as gpipe and 1f1b), "
        "round_robin (stage s on device s mod --num-devices, as interleaved_1f1b) or v "
        "(stages s and stages-1-s together, as zbv and dualpipev)",
    )
    # Above --uniform: it models copies with unit costs too, unlike the options below.
    c.add_argument(
        "--copy-ms",
        type=non_negative_float,
        default=0.0,
        help="modelled time of each copy (default 0)",
    )
    c.add_argument(
        "--uniform",
        action="store_true",
        help="unit costs instead of a profile (no ResNet50: the options below up to "
        "--no-memory do not apply)",
    )
    c.add_argument(
        "--device", type=device_here, help="where to profile and measure (default: detected)"
    )
    c.add_argument(
        "--balance",
        choices=BALANCES,
        help="ResNet50's cut: the tutorial's (2 or 4 stages) or balance_by_time's (default: "
        "the tutorial's where it exists, else time)",
    )
    c.add_argument(
        "--split-size", type=positive_int, help=f"images per micro-batch (default {SPLIT_SIZE})"
    )
    c.add_argument(
        "--image-size", type=positive_int, help=f"image side, >= 32 (default {IMAGE_SIZE})"
    )
    c.add_argument("--no-memory", action="store_true", help="skip the measured memory")
    c.add_argument("--no-plots", action="store_true", help="skip the PNG")
    c.add_argument(
        "--out", default="mpstream-schedules", help="output folder (default: %(default)s)"
    )
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Runs ``mpstream schedules``; returns the exit status.

    Raises:
        UsageError: more devices than stages, more stages than ResNet50 has
            blocks (without ``--uniform``), an image too small, a profile's
            option with ``--uniform``, ``--balance tutorial`` for a stage
            count the tutorial has no cut for, an ``--order`` that cannot
            be read or does not fit the stages, micro-batches or
            ``--order-placement``, or ``--order-placement`` without
            ``--order``.
    """
    if args.num_devices and args.old_devices:
        raise UsageError("--devices is the old spelling of --num-devices: give only --num-devices")
    if args.order_placement is not None and args.order is None:
        raise UsageError(
            f"--order-placement {args.order_placement} places the stages of your --order: "
            f"give --order FILE, or drop it (the built-in schedules place their own)"
        )
    placement = args.order_placement or "stage"
    typed = args.num_devices or args.old_devices
    order = orders.read(args.order) if args.order is not None else None
    # An order sets the stages and micro-batches it covers, unless given.
    named, covers = orders.covered(order) if order else (STAGES, MICROS)
    stages, micros = args.stages or named, args.micro_batches or covers
    devices = typed or DEVICES
    if devices > stages and typed:
        flag = "--num-devices" if args.num_devices else "--devices"
        raise UsageError(f"{flag} {devices} exceeds --stages {stages}: a device needs a stage")
    if devices > stages:  # the default --num-devices, which the user never typed
        raise UsageError(
            f"--stages {stages}: fewer than the {devices} devices simulated by default "
            f"(a device needs a stage); give --num-devices {stages}, or more stages"
        )
    if args.uniform:
        given = [f"--{o.replace('_', '-')}" for o in PROFILE_OPTIONS if getattr(args, o)]
        if given:
            raise UsageError(
                f"{', '.join(given)}: --uniform uses unit costs and profiles no ResNet50; "
                f"drop {'it' if len(given) == 1 else 'them'} or --uniform"
            )
    if not args.uniform and stages > RESNET50_LAYERS:
        raise UsageError(
            f"--stages {stages}: ResNet50 has {RESNET50_LAYERS} blocks, a stage needs one; "
            f"give at most {RESNET50_LAYERS} stages, or --uniform"
        )
    if order is not None:
        orders.checked(
            order,
            args.order,
            (stages, f"--stages {stages}: drop it, or give an order for {stages} stages"),
            (micros, f"--micro-batches {micros}: drop it, or give an order for {micros}"),
        )
        orders.placed(order, args.order, placement, stages, devices)
    split_size = args.split_size or SPLIT_SIZE
    image_size = args.image_size or IMAGE_SIZE
    if image_size < 32:
        raise UsageError("--image-size must be at least 32 (ResNet50 downsamples 32x)")
    if image_size == 32 and split_size == 1:
        raise UsageError(
            "--split-size 1 with --image-size 32: ResNet50 brings one image down to one pixel, "
            "and BatchNorm cannot train on one value per channel; use 2 or more images, or "
            "larger images"
        )
    from ..observe import compare  # the profile and plots load only when the command runs

    plots = extras.figures("schedules", not args.no_plots)

    if not args.uniform:
        from ..tutorial.analysis import TUTORIAL_SPLITS, resnet_stages

        balance = args.balance or ("tutorial" if stages in TUTORIAL_SPLITS else "time")
        if balance == "tutorial" and stages not in TUTORIAL_SPLITS:
            counts = " or ".join(str(n) for n in sorted(TUTORIAL_SPLITS))
            raise UsageError(
                f"--balance tutorial: the tutorial's cut exists for {counts} stages, not "
                f"{stages}; use --balance time"
            )
    skipped = compare.left_out(stages, devices)
    names: list[Order] = [n for n in SCHEDULES if n not in skipped]
    if order is not None:
        names.append(order)
    measured: dict[str, dict[str, int]] = {}
    meta: dict[str, object] = {"stages": stages, "devices": devices, "micro_batches": micros}
    if order is not None:
        meta.update(order_file=args.order, order=" ".join(order), order_placement=placement)
    if args.uniform:
        costs: list[Cost] = [(1.0, 1.0, 1.0)] * stages
        source = "unit costs: forward = input gradient = weight gradient = 1 ms"
    else:
        device = torch.device(args.device) if args.device else detect_devices(None)[0]
        pipe, x, y = resnet_stages(stages, micros, split_size, image_size, device, balance)
        loss_fn = torch.nn.functional.mse_loss
        print(f"profiling ResNet50 as {stages} stages on {device} ...", flush=True)
        costs = compare.profile_stages(pipe, x, y, loss_fn).per_stage()
        source = (
            f"ResNet50 ({split_size} images of {image_size}x{image_size} per micro-batch) "
            f"profiled on {device_name(device)}; balance {pipe.balance} ({balance})"
        )
        # The device profiled on, beside the simulated device count.
        profiled = metadata([device])
        profiled["profiled_on"] = profiled.pop("devices")
        meta.update(profiled, balance=pipe.balance)
        if not args.no_memory:
            virtual = stages // devices if stages % devices == 0 else None
            measured = compare.measure_memory(pipe, x, y, loss_fn, names, virtual)
    rows = compare.compare(
        costs,
        devices,
        micros,
        copy_times=args.copy_ms,
        schedules=names,
        order_placement=placement,
    )
    for r in rows:
        r.measured = measured.get(r.schedule, {})
    # The modelled copy time is said beside the costs: the table has no column for it.
    copies = f", each copy {args.copy_ms:g} ms" if args.copy_ms else ""
    machines = count_of(devices, "device")
    batches = count_of(micros, "micro-batch", "micro-batches")
    print(f"{stages} stages on {machines}, {batches}{copies}; {source}")
    for name, why in skipped.items():
        print(f"({name} left out: {why})")
    print(compare.table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        **meta,
        "source": source,
        "stage_costs_ms": costs,
        "copy_ms": args.copy_ms,
        "schedules": [
            {
                "schedule": r.schedule,
                "step_ms": r.step_ms,
                "device_idle_fraction": r.device_idle_fraction,
                "live_per_stage": r.live,
                "held_per_stage": r.held,
                "peak_activations_per_device": r.peak,
                "graph_launches": r.launches,
                "devices": r.devices,
                "measured_peak_bytes": r.measured,
            }
            for r in rows
        ],
    }
    (out / "schedules.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out / 'schedules.json'}")
    (out / "schedules.png").unlink(missing_ok=True)  # an earlier run's, beside these numbers
    if plots:
        title = f"{stages} stages, {machines}, {batches}{copies}; {source}"
        print(f"wrote {compare.plot_stacked(rows, out / 'schedules.png', title)}")
    return 0

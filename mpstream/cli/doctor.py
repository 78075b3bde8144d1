"""``mpstream doctor``'s command line: its options, read into a doctor run."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ..workloads.transformer import PRESETS
from .argtypes import UsageError, image_size, int_list, positive_int
from .resnet import lone_image

if TYPE_CHECKING:  # the experiment's modules need torchvision: imported in the command
    from ..tutorial.design import Config

#: What the doctor's steps import: figures and progress bars as they go, the
#: tutorial's models (``mpstream.cli.main`` checks before it runs).
NEEDS = ("torchvision", "matplotlib", "tqdm")

# The doctor's models and steps (mpstream.doctor's ARCHS and SKIPPABLE),
# held here because importing the doctor loads torchvision's models, and
# with them torch._dynamo: seconds on every command, help included
# (tests/cli/test_args.py checks the two agree).
ARCHS = ("resnet50", "resnet101", "transformer")
SKIPPABLE = (
    "environment", "correctness", "overlap", "races", "memory", "tutorial", "profile",
    "cost-model", "experiment",
)  # fmt: skip

__all__ = ["add_command"]


def _command(args: argparse.Namespace) -> int:
    from ..doctor import Options, check, run

    options = Options(
        out=Path(args.out),
        devices=args.devices,
        quick=args.quick,
        arch=args.model,
        preset=args.preset,
        skip=tuple(args.skip),
        progress=not args.no_progress,
        command=args.command_line,
        image_size=args.image_size,
        batch_size=args.batch_size,
        split_sizes=args.split_sizes,
    )
    try:
        _, sizes, _, _ = check(options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if options.arch != "transformer":
        _refuse_lone_images(sizes.experiment, args)
    return run(options)


def _refuse_lone_images(config: Config, args: argparse.Namespace) -> None:
    """Refuses the experiment's split sizes that leave a micro-batch of one
    32x32 image, as ``bench`` does, rather than FAIL its step minutes later.

    Raises:
        UsageError: naming the option that made it so.
    """
    w, h, batch = config.image_w, config.image_h, config.batch_size
    lone = [s for s in config.split_sizes if lone_image(w, h, batch, s)]
    if not lone:
        return
    if batch == 1:
        what = "--batch-size 1"
    elif args.split_sizes is not None:
        what = f"--split-sizes {lone[0]}"
    else:
        shown = ", ".join(map(str, config.split_sizes))
        what = f"--batch-size {batch} (default split sizes: {shown}; give --split-sizes)"
    raise UsageError(
        f"{what} with --image-size {w}x{h}: a micro-batch of one image, which the ResNets "
        "bring down to one pixel, and BatchNorm cannot train on one value per channel; use "
        "micro-batches of 2 or more images, or images larger than 32x32"
    )


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the ``doctor`` command to the ``mpstream`` parser."""
    d = sub.add_parser(
        "doctor",
        help="prove on this machine's GPUs that the pipeline is right and overlaps",
        description=(
            "Run, in order: environment, correctness against the CPU model, measured overlap, "
            "the CUDA sanitizers, memory over many steps, the tutorial's experiment, a profiled "
            "step and the cost model. One line per step as it goes (PASS / FAIL / SKIP), a "
            "summary table last, and a report (summary.md, report.json, figures, one archive) "
            "in --out. Steps that need a GPU SKIP without one. Exit code 1 if any step failed."
        ),
    )
    d.add_argument("--out", default="mpstream-doctor", help="report folder (default: %(default)s)")
    d.add_argument(
        "--devices", help="one or two devices, e.g. cuda:0 or cuda:0,cuda:1 (default: detected)"
    )
    d.add_argument(
        "--quick", action="store_true", help="short, CPU-sized run (automatic without a GPU)"
    )
    d.add_argument(
        "--model",
        choices=ARCHS,
        default="resnet50",
        help="the experiment's model (%(default)s); transformer: the same checks on a "
        "Llama-style decoder, with predictions for 2, 4 and 8 GPUs",
    )
    d.add_argument(
        "--preset",
        choices=list(PRESETS),
        help="the transformer's size (default: 1b on a GPU, tiny with --quick)",
    )
    workload = d.add_argument_group(
        "the experiment's workload",
        "steps 6-8 (the tutorial's experiment, where the time goes, the cost model) at your "
        "sizes instead of the tutorial's",
    )
    workload.add_argument(
        "--image-size",
        type=image_size,
        help="W or WxH (at least 32; at 32x32 every micro-batch needs 2 or more images)",
    )
    workload.add_argument("--batch-size", type=positive_int, help="images per step")
    workload.add_argument(
        "--split-sizes",
        type=int_list,
        help="split sizes compared, e.g. 16,32; the first is the main one "
        "(default: the standard ones that fit the batch)",
    )
    d.add_argument(
        "--skip",
        nargs="+",
        action="extend",
        default=[],
        choices=SKIPPABLE,
        metavar="STEP",
        help=f"steps not to run: {', '.join(SKIPPABLE)} "
        "(experiment: the transformer's, tutorial: the ResNets')",
    )
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    d.set_defaults(func=_command)

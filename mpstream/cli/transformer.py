"""``mpstream bench --model transformer``'s options, read into a run of
:mod:`mpstream.workloads.bench`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .._version import __version__
from .._words import count_of
from ..tutorial.machine import detect_devices, named_devices
from ..workloads import bench, report, transformer
from . import extras
from .argtypes import UsageError, int_list, positive_float, positive_int
from .signals import finish, terminate_as_interrupt

__all__ = ["add_options", "run", "given", "TUTORIAL_ONLY", "TRANSFORMER_ONLY"]

#: Options of the tutorial's experiment, which the transformer takes none of.
TUTORIAL_ONLY = ("split_size", "split_sizes", "batch_size", "num_batches", "image_size",
                 "num_classes", "no_sweep")  # fmt: skip
#: The work past which the bench on a CPU warns (about 10 minutes at
#: 100 GFLOP/s, which a laptop's cores reach in bf16 at best).
CPU_FLOP = 6e13
#: The transformer's options, which the tutorial's experiment takes none of.
TRANSFORMER_ONLY = ("preset", "micro_batches", "sequences", "seq_len", "peak_tflops")


def given(args: argparse.Namespace, names: tuple[str, ...]) -> str:
    """The options of ``names`` set in ``args``, as typed (``--seq-len``),
    comma-separated; empty if none."""
    return ", ".join(f"--{n.replace('_', '-')}" for n in names if getattr(args, n, None))


def add_options(p: argparse.ArgumentParser) -> None:
    """The transformer's options (a group of ``bench``'s)."""
    g = p.add_argument_group(
        "--model transformer",
        "a Llama-style decoder: single device, naive model parallel, mpstream's schedules and "
        "graphed stages over micro-batch counts (tokens/s, MFU, memory per stage)",
    )
    g.add_argument(
        "--preset",
        choices=list(transformer.PRESETS),
        help="the model's size (default: 1b on a GPU, tiny with --quick or on the CPU)",
    )
    g.add_argument(
        "--micro-batches",
        type=int_list,
        help="micro-batch counts, e.g. 2,4,8 (default: the preset's, up to --sequences)",
    )
    g.add_argument("--sequences", type=positive_int, help="sequences per step")
    g.add_argument("--seq-len", type=positive_int, help="tokens per sequence")
    known = list(dict.fromkeys(part.split()[0] for part, _ in bench.PEAKS))
    g.add_argument(
        "--peak-tflops",
        type=positive_float,
        help="every device's dense bf16 peak for MFU, which sums those of the devices a "
        f"configuration uses (default: each device's, known for {', '.join(known[:-1])} "
        f"and {known[-1]})",
    )


def _micro_batches(args: argparse.Namespace, name: str) -> tuple[int, ...]:
    """The micro-batch counts to time: ``--micro-batches``, else the
    preset's up to ``--sequences`` (as the ResNet sweep stops at the batch).

    Raises:
        UsageError: a count above the sequences of a step.
    """
    preset = transformer.PRESETS[name]
    sequences = args.sequences or preset.batch
    if args.micro_batches is None:
        return tuple(m for m in preset.micro_batches if m <= sequences) or (sequences,)
    over = [m for m in args.micro_batches if m > sequences]
    if over:
        given = "--sequences" if args.sequences else f"the {name} preset's; --sequences"
        raise UsageError(
            f"--micro-batches {over[0]}: more than the {count_of(sequences, 'sequence')} of a step "
            f"({given} sets them)"
        )
    return tuple(args.micro_batches)


def run(args: argparse.Namespace) -> int:
    """Runs the transformer bench as ``args`` say."""
    wrong = given(args, TUTORIAL_ONLY)
    if wrong:
        raise UsageError(
            f"{wrong}: options of the tutorial's experiment; the transformer takes "
            f"--preset, --micro-batches, --sequences, --seq-len and --peak-tflops"
        )
    try:
        dev0, dev1 = detect_devices(args.devices)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    name = args.preset or ("tiny" if args.quick or dev0.type != "cuda" else "1b")
    changes: dict[str, object] = {"micro_batches": _micro_batches(args, name)}
    for option, field in (
        ("sequences", "batch"), ("seq_len", "seq"),
        ("repeat", "repeat"), ("warmup", "warmup"),
    ):  # fmt: skip
        value = getattr(args, option, None)
        if value is not None:
            changes[field] = value
    try:
        preset = transformer.preset(name, **changes)
    except ValueError as exc:  # sizes that cannot work: the options'
        raise UsageError(str(exc)) from None
    config = bench.Config(preset, (dev0, dev1), peak=args.peak_tflops)
    plots = extras.figures("bench", not args.no_plots)
    print(
        f"mpstream {__version__} | torch {torch.__version__} | devices "
        f"{named_devices((dev0, dev1))} | transformer {preset.name}: "
        f"{transformer.param_count(preset) / 1e6:.1f}M parameters, "
        f"{preset.batch} x {preset.seq} tokens per step",
        flush=True,
    )
    keys = bench.keys_for(config)
    total = len(keys) * (preset.warmup + preset.repeat)
    work = transformer.flops_per_token(preset) * preset.batch * preset.seq * total
    if dev0.type != "cuda" and work > CPU_FLOP:
        # Asked for by name: run it, but say what it costs before the hours go.
        print(
            f"mpstream bench: warning: the {preset.name} preset is sized for GPUs: "
            f"{work / 1e12:.0f} TFLOP over {total} steps, hours on a CPU "
            f"(--preset tiny, or --quick, is the CPU's)",
            file=sys.stderr,
            flush=True,
        )
    with (
        extras.progress(total, "step", not args.no_progress) as bar,
        terminate_as_interrupt(lambda: bar.update(1)) as tick,
    ):
        results = bench.run(config, tick=tick, status=bar.set_description, interruptible=True)
    return finish(results, report.table, report.save, Path(args.out), plots)

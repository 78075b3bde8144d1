"""Profile ResNet50 block by block and compare the tutorial's split with a balanced one.

    python examples/balance_resnet50.py                  # CPU or cuda:0, 12 images of 128x128
    python examples/balance_resnet50.py --device cuda:0 --batch-size 12 --stages 2

Prints each layer's forward+backward time, each split's stage shares, and the
speed-up an ideal two-stage pipeline would reach with them (fill-drain:
``(M + S - 1) * slowest stage / M`` against the single-device sum). With
``--json`` the numbers are also written to a file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mpstream.cli.argtypes import device_here, positive_int
from mpstream.stages import partition, profile_layers, stage_costs
from mpstream.tutorial import resnet50_layers

TUTORIAL = [11, 12]  # stem + layer1 + layer2 | layer3 + layer4 + avgpool/flatten/fc


def ideal_speedup(stage_ms: list[float], micros: int) -> float:
    """Single-device time over an ideal fill-drain pipeline's time."""
    stages = len(stage_ms)
    return sum(stage_ms) / ((micros + stages - 1) * max(stage_ms) / micros)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--device",
        type=device_here,
        default="cuda:0" if torch.cuda.is_available() else "cpu",
        help="where to profile (default: %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        "--batch",
        type=positive_int,
        default=12,
        help="micro-batch size to profile (default: %(default)s)",
    )
    p.add_argument(
        "--image-size",
        "--image",
        type=positive_int,
        default=128,
        help="image side (default: %(default)s)",
    )
    p.add_argument(
        "--stages", type=positive_int, default=2, help="stages to balance (default: %(default)s)"
    )
    p.add_argument(
        "--micro-batches",
        type=positive_int,
        default=10,
        help="for the ideal speed-up (default: %(default)s)",
    )
    p.add_argument(
        "--repeat", type=positive_int, default=5, help="timed runs per layer (default: %(default)s)"
    )
    p.add_argument("--json", type=Path, help="also write the numbers here")
    args = p.parse_args()
    if args.batch_size < 2:
        p.error("--batch-size: at least 2 (training-mode BatchNorm needs more than one value)")
    if args.image_size < 32:
        p.error(f"--image-size {args.image_size}: at least 32 (ResNet50 downsamples 32x)")

    torch.manual_seed(0)
    layers = resnet50_layers()
    if args.stages > len(layers):
        p.error(f"--stages {args.stages}: ResNet50 has {len(layers)} blocks, a stage needs one")
    sample = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    profiles = profile_layers(layers, sample, device=args.device, repeat=args.repeat)
    times = [pr.time_ms for pr in profiles]
    shape = f"{args.batch_size}x3x{args.image_size}x{args.image_size}"
    print(f"device {args.device}, torch {torch.__version__}, micro-batch {shape}")
    for pr in profiles:
        split = f"{pr.forward_ms:.2f} fwd + {pr.backward_ms:.2f} bwd"
        print(f"  {pr.name:<10} {pr.time_ms:8.2f} ms   ({split})")
    splits = {"balanced": partition(times, args.stages)}
    if args.stages == 2:
        splits = {"tutorial": TUTORIAL, **splits}
    report = {
        "device": args.device,
        "torch": torch.__version__,
        "layer_ms": dict(zip([pr.name for pr in profiles], times)),
    }
    for name, balance in splits.items():
        stage_ms = stage_costs(times, balance)
        shares = [t / sum(stage_ms) for t in stage_ms]
        speedup = ideal_speedup(stage_ms, args.micro_batches)
        print(
            f"{name:>9}: balance {balance}, stage shares "
            + " / ".join(f"{100 * s:.0f}%" for s in shares)
            + f", ideal speed-up at {args.micro_batches} micro-batches {speedup:.2f}x"
        )
        report[name] = {
            "balance": balance,
            "stage_ms": stage_ms,
            "shares": shares,
            "ideal_speedup": speedup,
        }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

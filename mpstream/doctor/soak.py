"""Doctor step 5: memory stays flat over many steps, and the peaks of each schedule.

The soak trains a float64 chain through mpstream and the same chain on one
device side by side, alternating ``train_step`` (1F1B, checkpointing all but
the last micro-batch) with ``pipe(x)`` + ``backward``, from pinned host
memory and from the device. After every step it reads
``torch.cuda.memory_allocated`` on each device: after warm-up the series must
stay flat (:func:`memory_verdict`), and the losses and final parameters must
equal the single device's (:func:`drift`). The peak table is
``max_memory_allocated`` per device for one training step of the tutorial's
ResNet split, for each schedule x checkpoint mode.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..memory import CHECKPOINT_MODES
from ..pipe import Pipe
from ..runtime import synchronize
from ..schedules import SCHEDULES
from ..tutorial import models as tutorial
from ..tutorial.analysis import batch
from .checks import fits, named, virtual_stages
from .diagnosis import FAIL, PASS, Check, Context, StepResult, overall

__all__ = ["SLACK_BYTES", "memory_verdict", "drift", "soak", "peak_pipe", "peaks", "run"]

# What may legitimately differ between steps is a loss scalar (one 512-byte
# block); a leak of one micro-batch's activations here is 128 KiB or more
# (8 rows x 256 float64 per layer, 8 layers), and leaks add up every step.
SLACK_BYTES = 64 * 1024
WIDTHS = (128, 256, 256, 256, 128)


def memory_verdict(series: Sequence[int], slack: int = SLACK_BYTES) -> tuple[str, str]:
    """PASS if no reading after the first exceeds it by more than ``slack`` bytes.

    Args:
        series: bytes allocated on one device after each post-warm-up step.
        slack: tolerated growth.
    """
    if len(series) < 2:
        return FAIL, "too few steps to judge"
    growth = max(series) - series[0]
    detail = f"{series[0] / 2**20:.2f} MiB after warm-up, max +{growth} B over {len(series)} steps"
    return (PASS if growth <= slack else FAIL), detail


def drift(losses: Sequence[tuple[float, float]], pipe: nn.Module, ref: nn.Module) -> str | None:
    """None if losses and parameters equal the reference's, else the first difference."""
    try:
        mine = torch.tensor([a for a, _ in losses], dtype=torch.float64)
        theirs = torch.tensor([b for _, b in losses], dtype=torch.float64)
        torch.testing.assert_close(mine, theirs, msg=named("losses"))
        for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.cpu(), b.cpu(), msg=named(name))
    except AssertionError as exc:
        return (str(exc).strip().splitlines() or ["assertion failed"])[0]
    return None


def _chain() -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers).double()


def soak(
    devices: tuple[torch.device, torch.device],
    steps: int,
    warmup: int,
    allocated: Callable[[torch.device], int],
    tick: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Trains the pipe and the single-device chain for ``steps`` steps.

    Returns:
        ``series`` (bytes per device after each post-warm-up step),
        ``losses`` (pipe, reference) per step, and the drift verdict.
    """
    dev0, dev1 = devices
    stage_devices = [dev0, dev1, dev1]
    model = _chain()
    ref = copy.deepcopy(model).to(dev0)
    pipe = Pipe(
        copy.deepcopy(model),
        split_size=8,
        balance=[3, 3, 2],
        devices=stage_devices,
        schedule="1f1b",
        checkpoint="except_last",
        force_copies=dev0 == dev1 and dev0.type == "cuda",
    )
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (pipe, ref)]
    gen = torch.Generator().manual_seed(0)
    pool = [
        (
            torch.randn(32, WIDTHS[0], generator=gen, dtype=torch.float64),
            torch.randn(32, WIDTHS[-1], generator=gen, dtype=torch.float64),
        )
        for _ in range(4)
    ]
    pinned = dev0.type == "cuda"
    series: dict[str, list[int]] = {str(d): [] for d in dict.fromkeys(devices)}
    losses: list[tuple[float, float]] = []
    for step in range(steps):
        x, y = pool[step % len(pool)]
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        if step % 2 == 0:
            source = x.pin_memory() if pinned else x
            loss = pipe.train_step(source, y, nn.MSELoss())
        else:
            out = pipe(x.to(dev0))
            loss = nn.functional.mse_loss(out, y.to(out.device))
            torch.autograd.backward(loss)
            del out
        expected = nn.functional.mse_loss(ref(x.to(dev0)), y.to(dev0))
        torch.autograd.backward(expected)
        for opt in opts:
            opt.step()
        losses.append((float(loss.detach()), float(expected.detach())))
        del loss, expected
        synchronize(stage_devices)
        if step >= warmup:
            for d in dict.fromkeys(devices):
                series[str(d)].append(allocated(d))
        if tick is not None:
            tick()
    return {"series": series, "losses": losses, "drift": drift(losses, pipe, ref)}


def _train_step(pipe: Pipe, x: Tensor, y: Tensor) -> None:
    pipe.zero_grad(set_to_none=True)
    pipe.train_step(x, y, nn.MSELoss())
    synchronize(pipe.devices)


def peak_pipe(ctx: Context, schedule: str, checkpoint: str) -> Pipe:
    """The tutorial split as a Pipe of blocks for one row of the peak-memory table."""
    config = ctx.sizes.peak_config
    dev0, dev1 = ctx.devices
    torch.manual_seed(0)
    return tutorial.block_pipe(
        ctx.arch,
        dev0,
        dev1,
        config.split_size,
        config.num_classes,
        schedule=schedule,
        checkpoint=checkpoint,
        # Interleaved 1F1B on one device: one rank holds both stages.
        virtual_stages=virtual_stages(schedule, ctx.devices),
    )


def peaks(ctx: Context, tick: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """``max_memory_allocated`` per device of one training step per schedule x checkpoint mode."""
    config = ctx.sizes.peak_config
    dev0, dev1 = ctx.devices
    x, y = batch(config, dev0)
    y = y.to(dev1)
    rows = []
    runnable = [s for s in SCHEDULES if fits(s, ctx.devices)]  # a V needs one device here
    for schedule, checkpoint in itertools.product(runnable, CHECKPOINT_MODES):
        pipe = peak_pipe(ctx, schedule, checkpoint)
        _train_step(pipe, x, y)  # warm-up: gradients and workspaces exist from here on
        row: dict[str, Any] = {"schedule": schedule, "checkpoint": checkpoint}
        for d in dict.fromkeys(ctx.devices):
            torch.cuda.reset_peak_memory_stats(d)
            row[f"before[{d}]"] = torch.cuda.memory_allocated(d)
        _train_step(pipe, x, y)
        for d in dict.fromkeys(ctx.devices):
            row[f"max_memory_allocated[{d}]"] = torch.cuda.max_memory_allocated(d)
            row[f"step_peak[{d}]"] = row[f"max_memory_allocated[{d}]"] - row[f"before[{d}]"]
        rows.append(row)
        del pipe
        torch.cuda.empty_cache()
        if tick is not None:
            tick()
    return rows


def run(ctx: Context) -> StepResult:
    """The soak and the peak table (the step needs CUDA: allocator statistics)."""
    sizes = ctx.sizes
    with ctx.bar(sizes.soak_steps + 6, "memory") as bar:
        result = soak(
            ctx.devices,
            sizes.soak_steps,
            sizes.soak_warmup,
            torch.cuda.memory_allocated,
            lambda: bar.update(1),
        )
        table = peaks(ctx, lambda: bar.update(1))
    checks = []
    for device, series in result["series"].items():
        status, detail = memory_verdict(series)
        checks.append(Check(f"memory_allocated flat on {device}", status, detail))
    error = result["drift"]
    last = result["losses"][-1]
    checks.append(
        Check(
            f"{sizes.soak_steps} steps equal the single device (float64)",
            FAIL if error else PASS,
            error or f"last loss {last[0]:.6g} (single device {last[1]:.6g})",
        )
    )
    config = sizes.peak_config
    where = f"{ctx.arch} split, {config.batch_size} images of {config.image_w}x{config.image_h}"
    for row in table:
        mib = ", ".join(
            f"{k.split('[', 1)[1][:-1]} {v / 2**20:.0f} MiB"
            for k, v in row.items()
            if k.startswith("max_memory")
        )
        name = f"max_memory_allocated, {row['schedule']} / {row['checkpoint']} ({where})"
        checks.append(Check(name, PASS, mib, row))
    gpipe = next(r for r in table if r["schedule"] == "gpipe" and r["checkpoint"] == "never")
    peak = max(v for k, v in gpipe.items() if k.startswith("step_peak"))
    flat = all(c.status == PASS for c in checks[: len(result["series"])])
    figure = (
        f"memory {'flat' if flat else 'GROWS'} over {sizes.soak_steps} steps; "
        f"gpipe step peak {peak / 2**20:.0f} MiB above the weights"
    )
    status = overall(checks)
    reason = next((f"{c.name}: {c.detail}" for c in checks if c.status == FAIL), "")
    data = {
        "series_bytes": result["series"],
        "losses": result["losses"],
        "peaks": table,
        "slack_bytes": SLACK_BYTES,
    }
    return StepResult("memory", "Memory", status, figure, reason, checks, data)

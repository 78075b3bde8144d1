"""Experiment: capture one pipelined training step in a CUDA graph and replay it.

    python examples/cuda_graph_step.py                        # cuda:0, split 12, tutorial sizes
    python examples/cuda_graph_step.py --split-size 20 --json graph.json

Two stages of the tutorial's ResNet50 on one GPU (each on its own streams),
static input and target buffers. The step is ``zero_grad`` + ``train_step``
(no optimizer step, so every replay computes the same gradients). It times
the eager step, then tries ``torch.cuda.graph`` capture in each
``capture_error_mode`` ("global", "thread_local", "relaxed") until one works,
and reports for each what broke (the exception, verbatim, and whether at
capture or replay) or, once one works, the replay time against the eager
step and how far the replayed gradients are from the eager ones. Each mode
gets a fresh pipe, so one failure cannot spoil the next attempt.

On the H100 (docs/results/h100) the replay took 39.7 ms against 194.2 ms
eager, and 40.2 ms against 265.1 ms in an earlier run, when a step being
captured still took a failure snapshot (gradient clones on every replay).

Then the feature this experiment led to, :class:`mpstream.CapturedStep`, on
a fresh pipe with SGD (momentum 0.9) inside the graph: ``--steps`` captured
steps against the same steps run eagerly on a twin pipe, the median step
times, and how far the two pipes' parameters end up apart. It needs a CUDA
device; without one it says so and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mpstream import CapturedStep
from mpstream.cli.argtypes import device_here, positive_int
from mpstream.tutorial import StreamPipelineResNet50

MODES = ("global", "thread_local", "relaxed")


def timed(fn: Callable[[], Any], runs: int) -> list[float]:
    """Milliseconds of each of ``runs`` calls, timed with CUDA events."""
    out = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def grads(module: nn.Module) -> list[Tensor]:
    """A copy of every parameter's gradient (zeros where there is none)."""
    return [
        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for p in module.parameters()
    ]


def max_difference(a: list[Tensor], b: list[Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def build(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, Callable[[], Tensor]]:
    """A fresh pipe on ``device`` and its step, warmed up on a side stream."""
    torch.manual_seed(0)
    model = StreamPipelineResNet50(device, device, args.split_size, args.num_classes)
    pipe = model.__dict__["pipe"]
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    labels = torch.randint(args.num_classes, (args.batch_size,), device=device)
    y = torch.zeros(args.batch_size, args.num_classes, device=device).scatter_(
        1, labels[:, None], 1.0
    )
    loss_fn = nn.MSELoss()

    def step() -> Tensor:
        # set_to_none=False: the gradients are static buffers a graph can own.
        model.zero_grad(set_to_none=False)
        out: Tensor = pipe.train_step(x, y, loss_fn)
        return out

    # Warm-up on a side stream, as capture wants (lazy init, cuDNN autotuning).
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    return pipe, step


def attempt(mode: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Times the eager step of a fresh pipe, then captures it with ``mode``
    and replays it; what happened, as a dict. A fresh pipe per mode, so that
    a failed capture cannot spoil the next mode's attempt."""
    pipe, step = build(args, device)
    eager = statistics.median(timed(step, args.runs))
    eager_grads = grads(pipe)
    result: dict[str, Any] = {"capture_error_mode": mode, "eager_ms": eager, "captured": False}
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode=mode):  # type: ignore[arg-type,unused-ignore]
            loss = step()
        result["captured"] = True
        graph.replay()
        torch.cuda.synchronize(device)
        result["loss"] = float(loss)
        result["max_grad_difference"] = max_difference(grads(pipe), eager_grads)
        times = timed(graph.replay, args.runs)
        result.update(
            replay_ms=statistics.median(times),
            replay_over_eager=statistics.median(times) / eager,
        )
    except Exception as exc:  # the experiment's answer is the failure itself
        where = "replay" if result["captured"] else "capture"
        result.update(failed_at=where, error=f"{type(exc).__name__}: {exc}")
        result["traceback"] = traceback.format_exc(limit=12)
    return result


def captured_step(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """CapturedStep with an optimizer against the same eager steps on a twin pipe."""

    def twin() -> tuple[Any, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = StreamPipelineResNet50(device, device, args.split_size, args.num_classes)
        pipe = model.__dict__["pipe"]
        return pipe, torch.optim.SGD(pipe.parameters(), lr=1e-3, momentum=0.9)

    gen = torch.Generator(device).manual_seed(1)
    batches = [
        (
            torch.randn(
                args.batch_size, 3, args.image_size, args.image_size, device=device, generator=gen
            ),
            torch.randn(args.batch_size, args.num_classes, device=device, generator=gen),
        )
        for _ in range(args.steps)
    ]
    loss_fn = nn.MSELoss()
    result: dict[str, Any] = {"optimizer": "SGD(lr=1e-3, momentum=0.9)", "steps": args.steps}
    try:
        graphed, graphed_opt = twin()
        step = CapturedStep(graphed, *batches[0], loss_fn, optimizer=graphed_opt)
        eager, eager_opt = twin()

        def eager_step(x: Tensor, y: Tensor) -> Tensor:
            eager_opt.zero_grad(set_to_none=False)
            loss: Tensor = eager.train_step(x, y, loss_fn)
            eager_opt.step()
            return loss

        replay_ms: list[float] = []
        eager_ms: list[float] = []
        losses: list[tuple[Tensor, Tensor]] = []
        for x, y in batches:
            out: dict[str, Tensor] = {}
            replay_ms += timed(lambda: out.setdefault("graph", step(x, y)), 1)  # noqa: B023
            eager_ms += timed(lambda: out.setdefault("eager", eager_step(x, y)), 1)  # noqa: B023
            losses.append((out["graph"], out["eager"]))
        with torch.no_grad():  # parameters require grad: their difference need not
            difference = max(
                float((a - b).abs().max()) for a, b in zip(graphed.parameters(), eager.parameters())
            )
        # The eager twin's first step pays first-run costs (autotuning,
        # allocations) that capture's warm-up paid for the graph: leave it out.
        kept = slice(1, None) if len(batches) > 1 else slice(None)
        replay, eager_median = statistics.median(replay_ms[kept]), statistics.median(eager_ms[kept])
        result.update(
            captured=step.captured,
            replay_ms=replay,
            eager_ms=eager_median,
            replay_over_eager=replay / eager_median,
            # Training on random data is chaotic (rounding grows ~100x a
            # step), so the first step's losses are the sharp comparison.
            first_loss_difference=abs(float(losses[0][0]) - float(losses[0][1])),
            max_parameter_difference=difference,
        )
    except Exception as exc:  # the failure is the answer
        result.update(
            error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=12)
        )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--device", default="cuda:0", help="the GPU both halves share (default: %(default)s)"
    )
    p.add_argument(
        "--split-size",
        type=positive_int,
        default=12,
        help="images per micro-batch (default: %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        "--batch",
        type=positive_int,
        default=120,
        help="images per step (default: %(default)s), the tutorial's",
    )
    p.add_argument(
        "--image-size",
        "--image",
        type=positive_int,
        default=128,
        help="image side (default: %(default)s), the tutorial's",
    )
    p.add_argument(
        "--num-classes",
        "--classes",
        type=positive_int,
        default=1000,
        help="classes (default: %(default)s)",
    )
    p.add_argument(
        "--runs",
        type=positive_int,
        default=10,
        help="timed eager steps and replays (default: %(default)s)",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=10,
        help="CapturedStep steps against eager ones (default: %(default)s)",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_graph_step.py needs a CUDA device; none is available here", file=sys.stderr)
        return 1
    try:
        device = torch.device(device_here(args.device))
    except argparse.ArgumentTypeError as exc:
        p.error(f"argument --device: {exc}")
    if device.type != "cuda":
        p.error(f"argument --device: {device} is not a CUDA device; CUDA graphs need one")
    # Capture, timing events and synchronize use the current device.
    torch.cuda.set_device(device)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "split_size": args.split_size,
        "batch": args.batch_size,
        "image": args.image_size,
        "attempts": [],
    }
    for mode in MODES:
        result = attempt(mode, args, device)
        print(f"eager step (zero_grad + train_step): {result['eager_ms']:.2f} ms")
        if "error" in result:
            print(f"capture_error_mode={mode}: failed at {result['failed_at']}: {result['error']}")
        else:
            print(
                f"capture_error_mode={mode}: works; replay {result['replay_ms']:.2f} ms = "
                f"{result['replay_over_eager']:.2f}x the eager step; gradients differ from "
                f"eager by at most {result['max_grad_difference']:.3g}"
            )
        report["attempts"].append(result)
        if "error" not in result:
            break
    captured = captured_step(args, device)
    if "error" in captured:
        print(f"CapturedStep with SGD: failed: {captured['error']}")
    else:
        print(
            f"CapturedStep with SGD: replay {captured['replay_ms']:.2f} ms vs eager "
            f"{captured['eager_ms']:.2f} ms ({captured['replay_over_eager']:.2f}x) over "
            f"{args.steps} steps; first losses differ by "
            f"{captured['first_loss_difference']:.3g}, parameters at the end by at most "
            f"{captured['max_parameter_difference']:.3g} (float32 training amplifies rounding "
            f"about 100x a step: not zero by design)"
        )
    report["captured_step"] = captured
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

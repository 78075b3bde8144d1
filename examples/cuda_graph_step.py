"""Experiment: capture one pipelined training step in a CUDA graph and replay it.

    python examples/cuda_graph_step.py                        # cuda:0, split 12, tutorial sizes
    python examples/cuda_graph_step.py --split-size 20 --json graph.json

Two stages of the tutorial's ResNet50 on one GPU (each on its own streams),
static input and target buffers. The step is ``zero_grad`` + ``train_step``
(no optimizer step, so every replay computes the same gradients). It times
the eager step, then tries ``torch.cuda.graph`` capture in each
``capture_error_mode`` ("global", "thread_local", "relaxed") until one works,
and reports for each what broke (the exception, verbatim) or, once capture
works, the replay time against the eager step and how far the replayed
gradients are from the eager ones. Not a feature of mpstream: its result
decides whether graph capture of stage micro-batches becomes one. It needs a
CUDA device; without one it says so and exits with status 1.
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


def attempt(
    mode: str, pipe: nn.Module, step: Callable[[], Tensor], eager_ms: float, replays: int
) -> dict[str, Any]:
    """Captures ``step`` with ``mode`` and replays it; what happened, as a dict."""
    result: dict[str, Any] = {"capture_error_mode": mode}
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode=mode):  # type: ignore[arg-type,unused-ignore]
            loss = step()
    except Exception as exc:  # the experiment's answer is the failure itself
        result.update(captured=False, error=f"{type(exc).__name__}: {exc}")
        result["traceback"] = traceback.format_exc(limit=12)
        torch.cuda.synchronize()
        return result
    graph.replay()
    torch.cuda.synchronize()
    replayed = grads(pipe)
    times = timed(graph.replay, replays)
    result.update(
        captured=True,
        loss=float(loss),
        replay_ms=statistics.median(times),
        replay_over_eager=statistics.median(times) / eager_ms,
        replayed_grads=replayed,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--split-size", type=int, default=12)
    p.add_argument("--batch", type=int, default=120, help="images per step (the tutorial's)")
    p.add_argument("--image", type=int, default=128, help="image side (the tutorial's)")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--runs", type=int, default=10, help="timed eager steps and replays")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_graph_step.py needs a CUDA device; none is available here", file=sys.stderr)
        return 1
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = StreamPipelineResNet50(device, device, args.split_size, args.classes)
    pipe = model.__dict__["pipe"]
    x = torch.randn(args.batch, 3, args.image, args.image, device=device)
    labels = torch.randint(args.classes, (args.batch,), device=device)
    y = torch.zeros(args.batch, args.classes, device=device).scatter_(1, labels[:, None], 1.0)
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
    torch.cuda.synchronize()
    eager = timed(step, args.runs)
    eager_ms = statistics.median(eager)
    eager_grads = grads(pipe)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "split_size": args.split_size,
        "batch": args.batch,
        "image": args.image,
        "eager_ms": eager_ms,
        "attempts": [],
    }
    print(f"eager step (zero_grad + train_step): {eager_ms:.2f} ms (median of {args.runs})")
    for mode in MODES:
        result = attempt(mode, pipe, step, eager_ms, args.runs)
        replayed = result.pop("replayed_grads", None)
        if replayed is not None:
            result["max_grad_difference"] = max_difference(replayed, eager_grads)
            print(
                f"capture ({mode}): works; replay {result['replay_ms']:.2f} ms = "
                f"{result['replay_over_eager']:.2f}x the eager step; gradients differ from "
                f"eager by at most {result['max_grad_difference']:.3g}"
            )
        else:
            print(f"capture ({mode}): failed: {result['error']}")
        report["attempts"].append(result)
        if result["captured"]:
            break
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

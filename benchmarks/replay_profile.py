"""Where a replayed task's host time goes: the tutorial's ResNet as graphed stages.

``python benchmarks/replay_profile.py --out DIR`` trains the tutorial's split
of ResNet50 (two stages on ``cuda:0``, copies forced between them) at
224x224, batch 128, split 32, with SGD, four ways: graphed stages
(``Pipe(graphs=True)``) and eager stages, each through ``train_step`` and
through the tutorial's own loop (``loss.backward()``). Each way is profiled
by :func:`mpstream.observe.hostwork.host_breakdown`: host µs per task by
kind (Python, the autograd engine, graph launches, event records and
waits, eager kernel launches and how many), launches that blocked on a
full queue, and the host's share of the step without the profiler.

Writes ``DIR/replay-profile.json`` (everything, with the device, torch,
CUDA and commit), ``DIR/replay-profile.md`` (the table) and
``DIR/replay-trace.json.gz`` (the graphed ``train_step``'s Chrome trace).
Without a GPU (``--quick`` forces it) the stages run on the CPU with
emulated graphs and a small ResNet input, which checks the script, not
the numbers.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mpstream import Pipe
from mpstream.observe.hostwork import KINDS, Breakdown, host_breakdown
from mpstream.runtime.graphed import Emulated
from mpstream.schedules import Kind
from mpstream.tutorial import models as tutorial

VARIANTS = ("graphed train_step", "graphed loop", "eager train_step", "eager loop")


def _pipe(arch: str, device: torch.device, split: int, graphs: bool) -> Pipe:
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    backend: Any = graphs if cuda or not graphs else Emulated()
    return tutorial.block_pipe(arch, device, device, split, force_copies=cuda, graphs=backend)


def _tasks(pipe: Pipe, x: torch.Tensor, y: torch.Tensor, loop: bool) -> int:
    """A step's tasks: each stage's forward and backward of each micro-batch
    (and, in ``train_step``, any weight task its schedule splits off)."""
    size = pipe.split_size
    micros = -(-len(x) // size) if size else min(pipe.chunks or 1, len(x))
    if loop:
        return 2 * len(pipe.devices) * micros
    schedule = pipe.schedule_for(micros, x.device, training_step=True, target_device=y.device)
    passes = (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)
    return sum(1 for t in schedule.tasks if t.kind in passes)


def _step(pipe: Pipe, x: torch.Tensor, y: torch.Tensor, loop: bool) -> Callable[[], None]:
    loss_fn = nn.MSELoss()
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)

    def train_step() -> None:
        opt.zero_grad(set_to_none=False)
        pipe.train_step(x, y, loss_fn)
        opt.step()

    def user_loop() -> None:  # the tutorial's train(), on batches already there
        opt.zero_grad()
        loss_fn(pipe(x), y).backward()
        opt.step()

    return user_loop if loop else train_step


def measure(
    args: argparse.Namespace,
    device: torch.device,
    done: Callable[[dict[str, Breakdown], dict[str, list[str]]], None] | None = None,
) -> tuple[dict[str, Breakdown], dict[str, list[str]]]:
    """Each variant's breakdown, one pipe at a time (graph pools freed
    between), and what each warned (a graphed stage that ran eagerly says
    so here); ``done`` is told after each variant, so what finished is
    written even if a time limit stops the rest."""
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    y = torch.zeros(args.batch_size, tutorial.NUM_CLASSES, device=device)
    y[torch.arange(args.batch_size), torch.randint(0, tutorial.NUM_CLASSES, (args.batch_size,))] = 1
    out: dict[str, Breakdown] = {}
    warned: dict[str, list[str]] = {}
    for variant in VARIANTS:
        graphs, loop = variant.startswith("graphed"), variant.endswith("loop")
        pipe = _pipe(args.arch, device, args.split_size, graphs)
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trace = None
            if variant == VARIANTS[0] and args.out is not None:
                trace = str(Path(tmp) / "trace.json")
            out[variant] = host_breakdown(
                _step(pipe, x, y, loop), _tasks(pipe, x, y, loop), steps=args.steps,
                warmup=3 if device.type == "cuda" else 2, devices=pipe.devices, trace=trace,
            )  # fmt: skip
            if trace is not None:
                with (
                    open(trace, "rb") as src,
                    gzip.open(args.out / "replay-trace.json.gz", "wb") as dst,
                ):
                    shutil.copyfileobj(src, dst)
        warned[variant] = sorted({f"{w.category.__name__}: {w.message}" for w in seen})
        if graphs:
            eager = [st.reason for st in pipe.graph_report().stages if not st.graphed]
            warned[variant] += [f"stage ran eagerly: {r}" for r in eager]
        del pipe
        gc.collect()  # a pipe in a reference cycle would keep its graph pools
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{variant}: {out[variant].per_task()}", file=sys.stderr)
        for line in warned[variant]:
            print(f"  warned: {line}", file=sys.stderr)
        if done is not None:
            done(out, warned)
    return out, warned


def environment(device: torch.device) -> dict[str, Any]:
    """The device, driver, torch, CUDA and commit the numbers come from."""
    commit = os.environ.get("MPSTREAM_COMMIT")
    if commit is None and shutil.which("git"):
        got = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        commit = got.stdout.strip() or None
    env: dict[str, Any] = {
        "commit": commit or "unknown (set MPSTREAM_COMMIT)", "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(), "device": str(device),
    }  # fmt: skip
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        smi = shutil.which("nvidia-smi")
        if smi:
            q = [smi, "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(q, capture_output=True, text=True).stdout.strip()
    return env


def table(results: dict[str, Breakdown]) -> str:
    """Markdown: per variant, the step, then host µs per task by kind, then counts."""
    kinds = [k for k in KINDS if any(k in b.kinds for b in results.values())]
    head = ["variant", "tasks", "issue ms", "step ms", "host share", "profiled µs/task"]
    head += [f"{k} µs/task" for k in kinds]
    head += [
        "graph launches/task",
        "kernel launches/task",
        "event ops/task",
        "blocked launches/step",
        "graph launch µs (median / p99)",
    ]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, b in results.items():
        per = b.per_task()
        cells = [name, str(b.tasks), f"{b.issue_us / 1e3:.2f}", f"{b.step_us / 1e3:.2f}",
                 f"{b.issue_us / b.step_us:.0%}", f"{b.profiled_us / b.tasks:.0f}"]  # fmt: skip
        cells += [f"{per.get(k, 0.0):.1f}" for k in kinds]
        cells += [f"{b.counts.get(k, 0.0) / b.tasks:.2f}"
                  for k in ("graph launch", "kernel launch", "event record/wait")]  # fmt: skip
        cells.append(f"{b.blocked:.1f}")
        launch = b.launch_us.get("graph launch")
        cells.append(f"{launch['median']:.0f} / {launch['p99']:.0f}" if launch else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="folder for the JSON, table and trace")
    p.add_argument("--arch", default="resnet50", choices=sorted(tutorial.ARCHS))
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--split-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=5, help="steps timed, and steps profiled")
    p.add_argument("--quick", action="store_true", help="CPU, emulated graphs, small input")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.quick
    if not cuda:
        args.image_size, args.batch_size, args.split_size, args.steps = 32, 4, 2, 1
    device = torch.device("cuda:0" if cuda else "cpu")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    env = environment(device)

    def write(results: dict[str, Breakdown], warned: dict[str, list[str]]) -> str:
        report = {"environment": env, "config": config, "cpu": not cuda,
                  "variants": {k: b.to_json() for k, b in results.items()},
                  "warnings": warned, "suspect": suspect(results, cuda)}  # fmt: skip
        text = table(results)
        if args.out is not None:
            (args.out / "replay-profile.json").write_text(json.dumps(report, indent=1))
            title = "CPU, emulated graphs: checks the script, not the numbers" if not cuda else ""
            notes = "".join(f"- {v}: {w}\n" for v, ws in warned.items() for w in ws)
            notes += "".join(f"- {line}\n" for line in report["suspect"])
            (args.out / "replay-profile.md").write_text(
                f"# Host time per task {title}\n\n{text}" + (f"\n{notes}" if notes else "")
            )
        return text

    results, warned = measure(args, device, write)
    print(write(results, warned))
    return 0


def suspect(results: dict[str, Breakdown], cuda: bool) -> list[str]:
    """Rows whose numbers do not measure what their name says: a graphed
    variant on a GPU that launched no graph (its stages ran eagerly)."""
    return [
        f"{name}: no graph launch on the GPU: its stages ran eagerly, this row is not graphed"
        for name, b in results.items()
        if cuda and name.startswith("graphed") and not b.counts.get("graph launch")
    ]


if __name__ == "__main__":
    sys.exit(main())

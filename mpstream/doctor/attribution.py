"""Doctor step 7: where the time of a training step goes.

The tutorial's split of the model (as a :class:`~mpstream.Pipe` of blocks;
on one GPU with ``force_copies``, so the copies of a two-GPU layout run too)
trains on batches already on the devices, at each split size of the
experiment, under :func:`mpstream.profile`: a Gantt chart and a Chrome trace,
the bubble fraction and the copy time hidden behind compute.

Host-bound analysis: one host thread issues every kernel of a step. The
same steps are timed again without the profiler, once until the host has
issued everything (``issue``) and once until the devices are done
(``step``). When issuing takes nearly the whole step while even the busiest
stream idles for a good part of it, the host thread is the bottleneck
(:func:`host_bound`). On a GPU the main split is profiled again with its
stages replayed from CUDA graphs (``Pipe(graphs=True)``), and judged the same
way; then every schedule is trained eagerly, with graphed stages and as a
captured step (:mod:`~mpstream.doctor.graphed`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..observe.profiling import profile
from ..observe.timeline import Timeline
from ..pipe import Pipe
from ..runtime import synchronize
from ..schedules import SCHEDULES
from ..tutorial import models as tutorial
from ..tutorial.analysis import batch
from ..tutorial.bench import Config
from .diagnosis import PASS, SKIP, Check, Context, StepResult
from .experiment import config_for
from .graphed import schedule_checks, schedule_rows, time_steps

__all__ = ["ISSUE_RATIO", "IDLE_RATIO", "host_bound", "profile_step", "run"]

# Host-bound: issuing takes at least this share of the step...
ISSUE_RATIO = 0.8
# ...while the busiest stream computes at most this share of it.
IDLE_RATIO = 0.8


def host_bound(issue_ms: float, step_ms: float, busy: dict[str, float]) -> dict[str, Any]:
    """Whether the single host thread limits the step, with the numbers that say so.

    Args:
        issue_ms: host time to issue one step (until the call returns).
        step_ms: time until the devices finished the step.
        busy: busy milliseconds per stream during a step.
    """
    stream, most = max(busy.items(), key=lambda kv: kv[1]) if busy else ("-", 0.0)
    bound = step_ms > 0 and issue_ms >= ISSUE_RATIO * step_ms and most <= IDLE_RATIO * step_ms
    share = issue_ms / step_ms if step_ms > 0 else 0.0
    text = (
        f"issuing a step takes the host {issue_ms:.1f} ms of the {step_ms:.1f} ms step "
        f"({100 * share:.0f}%); the busiest stream, {stream}, is busy {most:.1f} ms "
        f"({100 * most / step_ms if step_ms > 0 else 0:.0f}%)"
    )
    verdict = ("the host thread is the bottleneck: " if bound else "not host-bound: ") + text
    return {
        "host_bound": bound,
        "issue_ms": issue_ms,
        "step_ms": step_ms,
        "busiest_stream": stream,
        "busiest_ms": most,
        "issue_share": share,
        "verdict": verdict,
    }


def _stepper(pipe: Pipe, config: Config) -> Callable[[], None]:
    dev0, dev1 = pipe.devices[0], pipe.devices[-1]
    x, y = batch(config, dev0)
    y = y.to(dev1)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.001)

    def step() -> None:
        opt.zero_grad()
        torch.autograd.backward(nn.functional.mse_loss(pipe(x), y))
        opt.step()

    return step


def profile_step(ctx: Context, split: int, graphs: bool = False) -> dict[str, Any]:
    """Profiles ``profile_steps`` training steps at ``split``; times issue and
    step apart. With ``graphs``, the stages replay CUDA graphs (captured in
    the warm-up step)."""
    config = config_for(ctx)
    dev0, dev1 = ctx.devices
    torch.manual_seed(0)
    pipe = tutorial.block_pipe(
        ctx.arch,
        dev0,
        dev1,
        split,
        config.num_classes,
        force_copies=ctx.cuda and dev0 == dev1,
        graphs=graphs,
    )
    step = _stepper(pipe, config)
    devices = pipe.devices
    step()  # warm-up
    synchronize(devices)
    with profile(pipe) as prof:
        for _ in range(ctx.sizes.profile_steps):
            step()
            synchronize(devices)  # one run per step, none overlapping the next
    timed = time_steps(step, devices, ctx.sizes.profile_steps)
    return {
        "split": split,
        "balance": pipe.balance,
        "timeline": prof,
        "issue_ms": timed["issue_ms"],
        "step_ms": timed["step_ms"],
        "forced_copies": pipe.force_copies,
    }


def run(ctx: Context) -> StepResult:
    """Profiles each split size; the experiment's main one is drawn and traced."""
    config = config_for(ctx)
    splits = list(dict.fromkeys([config.split_size, *config.split_sizes]))
    profiles = {}
    with ctx.bar(len(splits), "profile") as bar:
        for split in splits:
            profiles[split] = profile_step(ctx, split)
            bar.update(1)
    ctx.shared["profiles"] = profiles
    main = profiles[config.split_size]
    prof: Timeline = main["timeline"]
    dev0, dev1 = ctx.devices
    copies = " (copies forced on one GPU)" if main["forced_copies"] else ""
    prof.plot(
        ctx.out / "timeline.png",
        title=f"{ctx.arch} training step on {dev0} | {dev1}{copies}, split {config.split_size}, "
        f"{config.batch_size} images of {config.image_w}x{config.image_h} "
        f"(last of {ctx.sizes.profile_steps}; numbers are micro-batches)",
    )
    prof.export_chrome_trace(ctx.scratch / "trace.json")
    summary = prof.summary(echo=False)
    busy = prof.stream_busy()
    checks = []
    rows = {}
    for split, p in profiles.items():
        s = p["timeline"].summary(echo=False)
        hidden = "-" if s.copy_hidden_fraction is None else f"{100 * s.copy_hidden_fraction:.0f}%"
        detail = (
            f"makespan {s.makespan_ms:.1f} ms, {s.bubble_text()}, "
            f"copy hidden {hidden}; step {p['step_ms']:.1f} ms, host issue {p['issue_ms']:.1f} ms"
        )
        checks.append(Check(f"profiled step at split {split}", PASS, detail))
        rows[str(split)] = {**s.to_dict(), "issue_ms": p["issue_ms"], "step_ms": p["step_ms"]}
    graphed: dict[str, Any] = {}
    if ctx.cuda:
        verdict = host_bound(main["issue_ms"], main["step_ms"], busy)
        checks.append(Check("host-bound analysis", PASS, verdict["verdict"], verdict))
        # The same step with each stage replayed from CUDA graphs: what is
        # left of the host's share (step 8 predicts more GPUs from it).
        again = profile_step(ctx, config.split_size, graphs=True)
        ctx.shared["graphed_profile"] = again
        found = host_bound(again["issue_ms"], again["step_ms"], again["timeline"].stream_busy())
        name = f"host-bound analysis, graphed stages (Pipe(graphs=True)), split {config.split_size}"
        checks.append(Check(name, PASS, found["verdict"], found))
        graphed = {"issue_ms": again["issue_ms"], "step_ms": again["step_ms"], **found}
        # Each schedule eager, graphed and captured, beside the single device.
        with ctx.bar(3 * len(SCHEDULES) + 2, "graphed") as bar:
            graphed["schedules"] = schedule_rows(ctx, tick=lambda: bar.update(1))
        ctx.shared["graphed_schedules"] = graphed["schedules"]  # step 8's baseline
        checks.extend(schedule_checks(graphed["schedules"], ctx.cuda, config.split_size))
    else:
        verdict = {
            "host_bound": None,
            "verdict": "not applicable on the CPU: the host runs "
            "every task itself, so issuing is the work",
        }
        checks.append(Check("host-bound analysis", SKIP, verdict["verdict"]))
    hidden = (
        "no copies"
        if summary.copy_hidden_fraction is None
        else f"copy hidden {100 * summary.copy_hidden_fraction:.0f}%"
    )
    figure = f"split {config.split_size}: {summary.bubble_text()}, {hidden}"
    if verdict["host_bound"]:
        figure += "; HOST-BOUND"
    reason = verdict["verdict"] if verdict["host_bound"] else ""
    data = {"splits": rows, "stream_busy_ms": busy, "host_bound": verdict, "graphed": graphed}
    files = ["timeline.png", "trace.json"]
    return StepResult("profile", "Where the time goes", PASS, figure, reason, checks, data, files)

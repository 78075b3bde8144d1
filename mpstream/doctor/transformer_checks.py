"""``mpstream doctor --model transformer``: correctness and races on the transformer workload.

The ResNet steps' proof, on :mod:`mpstream.workloads`'s decoder: every
schedule and checkpoint mode (and graphed stages on a GPU) against the
unsplit model in float64; and step 4's sanitizers, with CSAN over the
transformer's own steps (:func:`race_workload`, run in a child process).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
from torch import nn

from ..pipe import Pipe
from ..schedules import SCHEDULES, placement_of
from ..workloads import transformer
from .checks import placed, virtual_stages
from .diagnosis import FAIL, PASS, Check, Context, StepResult, overall
from .sanitizer import DONE, _env, _run, judge_csan

__all__ = ["correctness", "races", "race_workload"]


def correctness(ctx: Context) -> StepResult:
    """Every schedule, checkpoint mode and micro-batch count (one not
    dividing the batch) against the unsplit model, float64, on the CPU."""
    p = transformer.preset("tiny")
    dev0, dev1 = ctx.devices
    ref = transformer.decoder(p).double()
    x, y = transformer.tokens(p)
    loss = transformer.loss_fn(ref(x), y)
    torch.autograd.backward([loss])
    want = {n: q.grad for n, q in ref.named_parameters()}
    cases: list[tuple[str, dict[str, Any]]] = []
    for schedule in SCHEDULES:
        for checkpoint in ("never", "except_last", "always"):
            for chunks in (2, 3):
                cases.append(
                    (
                        f"{schedule}, checkpoint {checkpoint}, {chunks} micro-batches",
                        {"schedule": schedule, "checkpoint": checkpoint, "chunks": chunks},
                    )
                )
    if ctx.cuda:
        for schedule in ("gpipe", "1f1b", "zb_h1"):
            cases.append(
                (
                    f"{schedule}, graphed stages, 4 micro-batches",
                    {"schedule": schedule, "chunks": 4, "graphs": True},
                )
            )
    checks = []
    with ctx.bar(len(cases), "transformer cases") as bar:
        for name, options in cases:
            checks.append(_case(name, options, ref, x, y, loss, want, (dev0, dev1)))
            bar.update(1)
    equal = sum(c.status == PASS for c in checks)
    figure = (
        f"{equal}/{len(checks)} cases equal the unsplit model in float64 (loss, every gradient)"
    )
    reason = next((f"{c.name}: {c.detail}" for c in checks if c.status == FAIL), "")
    return StepResult("correctness", "Correctness", overall(checks), figure, reason, checks)


def _case(
    name: str,
    options: dict[str, Any],
    ref: nn.Sequential,
    x: torch.Tensor,
    y: torch.Tensor,
    loss: torch.Tensor,
    want: dict[str, Any],
    devices: tuple[torch.device, torch.device],
) -> Check:
    p = transformer.preset("tiny")
    schedule = options["schedule"]
    several = placement_of(schedule) != "stage"  # four stages, as the schedule places them
    balance = [2, 1, 2, 1] if several else transformer.halves(p)
    devs = placed(schedule, 4, list(devices)) if several else list(devices)
    vs = virtual_stages(schedule, devs)
    try:
        pipe = Pipe(copy.deepcopy(ref), balance=balance, devices=devs, virtual_stages=vs, **options)
        for _ in range(2 if options.get("graphs") else 1):  # capture, then replay
            pipe.zero_grad()
            got = pipe.train_step(x, y, transformer.loss_fn)
        torch.testing.assert_close(got.cpu(), loss.detach())
        for n, q in pipe.named_parameters():
            torch.testing.assert_close(q.grad.cpu(), want[n], msg=f"gradient of {n}")  # type: ignore[union-attr]
        if options.get("graphs") and not all(s.graphed for s in pipe.graph_report().stages):
            return Check(name, FAIL, f"a stage ran eagerly: {pipe.graph_report()}")
    except AssertionError as exc:
        return Check(name, FAIL, (str(exc).strip().splitlines() or ["differs"])[0])
    except Exception as exc:  # a crash fails its case, not the other cases' findings
        first = (str(exc).strip().splitlines() or [""])[0]
        return Check(name, FAIL, f"{type(exc).__name__}: {first}")
    return Check(name, PASS, "equal")


def race_workload(devices: list[str]) -> None:
    """Every schedule's ``train_step`` and the user's own loop on the tiny
    transformer over ``devices`` (run under CSAN by :func:`races`)."""
    from .sanitizer import csan_workarounds

    p = transformer.preset("tiny")
    devs = [torch.device(d) for d in devices]
    x, y = transformer.tokens(p, devs[0])
    with csan_workarounds():
        for schedule in SCHEDULES:
            several = placement_of(schedule) != "stage"
            stage_devs = placed(schedule, 4, devs) if several else devs
            vs = virtual_stages(schedule, stage_devs)
            pipe = Pipe(
                transformer.decoder(p),
                balance=[2, 1, 2, 1] if several else transformer.halves(p),
                devices=stage_devs,
                chunks=3,
                schedule=schedule,
                virtual_stages=vs,
                force_copies=devs[0] == devs[1],
            )
            opt = torch.optim.AdamW(pipe.parameters())
            for _ in range(2):
                opt.zero_grad()
                pipe.train_step(x, y.to(devs[-1]), transformer.loss_fn)
                opt.step()
            torch.autograd.backward([transformer.loss_fn(pipe(x), y.to(devs[-1]))])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(DONE, flush=True)


def races(ctx: Context) -> StepResult:
    """Step 4's sanitizers, and CSAN over the transformer's own steps."""
    from . import sanitizer

    result = sanitizer.run(ctx)
    dev0, dev1 = (str(d) for d in ctx.devices)
    entry = "from mpstream.doctor.transformer_checks import race_workload; race_workload"
    cmd = [sys.executable, "-c", f"{entry}({[dev0, dev1]!r})"]
    log = ctx.scratch / "csan-transformer.log"
    name = f"CUDA sanitizer over the transformer's train_step and own loop on {dev0} | {dev1}"
    code, out, err = _run(cmd, _env(TORCH_CUDA_SANITIZER="1"), ctx.sizes.sanitizer_timeout_s, log)
    if code is None:
        check = Check(name, FAIL, f"did not finish within {ctx.sizes.sanitizer_timeout_s} s")
    else:
        status, detail, found = judge_csan(code, out, err)
        check = Check(name, status, detail, {"races": found, "log": log.name})
    result.checks.append(check)
    result.files.append(log.name)
    result.status = overall(result.checks)
    result.figure += f"; transformer: {check.detail}"
    if check.status == FAIL and not result.reason:
        result.reason = f"{check.name}: {check.detail}"
    return result

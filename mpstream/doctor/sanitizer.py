"""Doctor step 4: no race under PyTorch's CUDA sanitizer, no memory error under memcheck.

:func:`workload` is what runs, in a subprocess, under ``TORCH_CUDA_SANITIZER=1``
(CSAN, which checks every kernel's reads and writes against the stream
order): pipelined forward + backward from device, pageable and pinned
input, with and without ``force_copies``, and a ``train_step`` for every
schedule (with checkpointing and deferred BatchNorm) from host and device
targets. ``compute-sanitizer --tool memcheck`` runs a short version when the
tool is on the PATH, and a second workload with every stage replayed from
CUDA graphs (:func:`graphed_workload`: captures, replays, a zero-bubble
weight pass), with PyTorch's caching allocator on, which graphs need. CSAN
is not run over graphs: a replay bypasses the dispatcher it watches.
:func:`judge_csan`, :func:`judge_memcheck` and :func:`judge_graphed` decide
from the subprocess's output, so their logic is tested without a GPU; the
workloads themselves also run on the CPU.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop

from ..pipe import Pipe
from ..schedules import SCHEDULES
from .checks import fits, virtual_stages
from .diagnosis import FAIL, PASS, SKIP, Check, Context, StepResult, overall

__all__ = [
    "DONE",
    "csan_workarounds",
    "workload",
    "graphed_workload",
    "exercise",
    "command",
    "judge_csan",
    "judge_memcheck",
    "judge_graphed",
    "csan",
    "memcheck",
    "run",
]

DONE = "mpstream sanitizer workload finished"
GRAPHED = "mpstream graphed workload: every stage replayed graphs"
CSAN_MARK = "CSAN detected a possible data race"


def _batch(rows: int, width: int, where: str, device: torch.device) -> torch.Tensor:
    x = torch.randn(rows, width)
    if where == "pinned":
        return x.pin_memory()
    return x if where == "pageable" else x.to(device)


@contextlib.contextmanager
def csan_workarounds() -> Iterator[None]:
    """Keeps two flaws of PyTorch's CUDA sanitizer (seen on torch 2.11) out of its verdict.

    - CSAN keys a tensor without storage by ``id()``, which Python reuses
      once the tensor is freed: two empty tensors made on two streams (the
      empty workspace cuDNN's batch norm returns, for one) look like one
      tensor written by both, a race on no memory at all. Tensors with no
      elements are left out of its bookkeeping here.
    - Its trace hooks run Python code even while an exception is
      propagating; the hook then fails and clears that exception, and
      autograd raises ``SystemError: ... returned NULL without setting an
      exception`` instead (seen under CSAN in a checkpointed ``train_step``,
      and with hooks on, in compiled stages). Non-reentrant checkpointing
      ends its recomputation early by raising an exception, so early
      stopping is turned off here: the same tensors are recomputed, and the
      ones after the last needed too.

    Importing ``torch.cuda._sanitizer`` registers CSAN's trace hooks for the
    whole process, enabled or not (torch 2.11), so it is imported here, in
    the sanitizer's own subprocess, never at module level.
    """
    from torch.cuda import _sanitizer

    handler = _sanitizer.ArgumentHandler
    handle = handler._handle_argument

    def handle_argument(self: Any, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, torch.Tensor) and value.numel() == 0:
            return  # no memory: nothing to race on
        handle(self, value, *args, **kwargs)

    handler._handle_argument = handle_argument  # type: ignore[method-assign]
    try:
        with set_checkpoint_early_stop(False):
            yield
    finally:
        handler._handle_argument = handle  # type: ignore[method-assign]


def workload(layouts: Sequence[Sequence[str]], short: bool = False) -> None:
    """Runs :func:`exercise` over each layout, then prints :data:`DONE`.

    Args:
        layouts: one device per stage each, e.g. ``[['cuda:0', 'cuda:0']]``.
        short: one configuration per path (for memcheck, which is slow).
    """
    with csan_workarounds():
        for devices in layouts:
            exercise(devices, short)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(DONE, flush=True)


def exercise(devices: Sequence[str], short: bool = False) -> None:
    """Exercises every stream path of a pipeline over ``devices``."""
    torch.manual_seed(0)
    devs = [torch.device(d) for d in devices]
    cuda = devs[0].type == "cuda"
    # Host input is pageable or pinned only where pinning exists.
    sources = ("device", "pageable", "pinned") if cuda else ("device",)
    n = len(devs)
    base = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in devs])
    for force in (False,) if short else (False, True):
        pipe = Pipe(
            copy.deepcopy(base), split_size=3, balance=[1] * n, devices=devs, force_copies=force
        )
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for source in sources[:2] if short else sources:
            x = _batch(10, 32, source, devs[0])
            if source != "device":
                x.requires_grad_()  # the input's gradient travels back to the host
            opt.zero_grad()
            pipe(x).pow(2).mean().backward()
            opt.step()
    for schedule in [s for s in SCHEDULES if fits(s, devs)]:
        for checkpoint in ("never",) if short else ("never", "except_last"):
            stepper = Pipe(
                nn.Sequential(
                    *[nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32)) for _ in devs]
                ),
                split_size=4,
                balance=[1] * n,
                devices=devs,
                schedule=schedule,
                checkpoint=checkpoint,
                deferred_batch_norm=True,
                force_copies=cuda,
                virtual_stages=virtual_stages(schedule, devs),
            )
            for source in sources[-1:] if short else sources:
                target = _batch(12, 32, source, devs[-1])
                stepper.train_step(_batch(12, 32, source, devs[0]), target, nn.MSELoss())


def graphed_workload(device: str) -> None:
    """``train_step`` with every stage replayed from graphs on ``device``
    (two stages), for each schedule, three steps; prints :data:`GRAPHED`
    when every stage of every pipe replayed, then :data:`DONE`."""
    torch.manual_seed(0)
    devs = [torch.device(device)] * 2
    replayed = True
    for schedule in [s for s in SCHEDULES if fits(s, devs)]:
        pipe = Pipe(
            nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in devs]),
            split_size=4,
            balance=[1] * len(devs),
            devices=devs,
            schedule=schedule,
            checkpoint="never",
            graphs=True,
            virtual_stages=virtual_stages(schedule, devs),
        )
        for _ in range(3):
            pipe.train_step(torch.randn(12, 32, device=devs[0]), torch.randn(12, 32), nn.MSELoss())
        replayed = replayed and all(s.graphed for s in pipe.graph_report().stages)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(GRAPHED if replayed else "mpstream graphed workload: a stage ran eagerly", flush=True)
    print(DONE, flush=True)


def command(layouts: Sequence[Sequence[str]], short: bool = False) -> list[str]:
    """The subprocess command line that runs :func:`workload`."""
    plain = [list(devices) for devices in layouts]
    code = f"from mpstream.doctor.sanitizer import workload; workload({plain!r}, short={short})"
    return [sys.executable, "-c", code]


def _env(**extra: str) -> dict[str, str]:
    # The subprocess must import this mpstream, wherever it was imported from.
    root = str(Path(__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else ""), **extra}


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def judge_csan(returncode: int, stdout: str, stderr: str) -> tuple[str, str, int]:
    """Status, detail and number of race reports of a CSAN run."""
    races = stderr.count(CSAN_MARK)
    if races:
        return FAIL, f"{races} race report(s): {_tail(stderr.split(CSAN_MARK, 1)[1], 2)}", races
    if returncode != 0 or DONE not in stdout:
        return FAIL, f"exit code {returncode}: {_tail(stderr)}", 0
    return PASS, "0 race reports", 0


def judge_memcheck(returncode: int, output: str) -> tuple[str, str, int | None]:
    """Status, detail and error count of a ``compute-sanitizer`` run."""
    found = re.search(r"ERROR SUMMARY:\s*(\d+)\s+error", output)
    errors = int(found.group(1)) if found else None
    if errors:
        return (
            FAIL,
            f"{errors} memcheck error(s): {_tail(output.split('=========', 1)[-1])}",
            errors,
        )
    if errors is None or returncode != 0 or DONE not in output:
        return FAIL, f"exit code {returncode}, no clean summary: {_tail(output)}", errors
    return PASS, "ERROR SUMMARY: 0 errors", 0


def judge_graphed(returncode: int, output: str) -> tuple[str, str, int | None]:
    """:func:`judge_memcheck`, and SKIP where a stage ran eagerly (its
    capture failed under the tool): then the graphs went unchecked."""
    status, detail, errors = judge_memcheck(returncode, output)
    if status == PASS and GRAPHED not in output:
        return SKIP, "inconclusive: a stage ran eagerly, so no graph ran under memcheck", errors
    return status, detail, errors


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _run(
    cmd: list[str], env: dict[str, str], timeout: int, log: Path
) -> tuple[int | None, str, str]:
    """Runs ``cmd``: exit code (None on timeout), stdout and stderr, all kept in ``log``."""
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = None, _text(exc.stdout), _text(exc.stderr)
    log.write_text(f"$ {shlex.join(cmd)}\nexit code: {code}\n--- stdout\n{out}\n--- stderr\n{err}")
    return code, out, err


def csan(layouts: Sequence[Sequence[str]], timeout: int, log: Path) -> Check:
    """One CSAN subprocess over every layout; its output goes to ``log``."""
    where = "; ".join(" | ".join(devices) for devices in layouts)
    name = f"CUDA sanitizer (TORCH_CUDA_SANITIZER=1) on {where}"
    code, out, err = _run(command(layouts), _env(TORCH_CUDA_SANITIZER="1"), timeout, log)
    if code is None:
        return Check(name, FAIL, f"did not finish within {timeout} s", {"log": log.name})
    status, detail, races = judge_csan(code, out, err)
    return Check(name, status, detail, {"races": races, "returncode": code, "log": log.name})


def memcheck(devices: Sequence[str], timeout: int, log: Path, graphs: bool = False) -> Check:
    """``compute-sanitizer --tool memcheck`` over the short workload, or with
    ``graphs`` over :func:`graphed_workload` (SKIP without the tool)."""
    name = "compute-sanitizer --tool memcheck" + (", graphed stages" if graphs else "")
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        return Check(name, SKIP, "compute-sanitizer is not on the PATH")
    if graphs:  # graphs allocate from the caching allocator's private pools
        entry = "from mpstream.doctor.sanitizer import graphed_workload; graphed_workload"
        workload, env = [sys.executable, "-c", f"{entry}({devices[0]!r})"], _env()
    else:  # without the cache, every allocation is the tool's to check
        workload, env = command([devices], True), _env(PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    # API errors are PyTorch probing features (expected failures), not memory errors.
    cmd = [tool, "--tool", "memcheck", "--report-api-errors", "no", *workload]
    code, out, err = _run(cmd, env, timeout, log)
    if code is None:
        detail = f"did not finish within {timeout} s (inconclusive)"
        return Check(name, SKIP, detail, {"log": log.name})
    judge = judge_graphed if graphs else judge_memcheck
    status, detail, errors = judge(code, f"{out}\n{err}")
    return Check(name, status, detail, {"errors": errors, "returncode": code, "log": log.name})


def run(ctx: Context) -> StepResult:
    """CSAN on one GPU (copies forced) and across two GPUs when present; then memcheck."""
    dev0, dev1 = (str(d) for d in ctx.devices)
    layouts = [[dev0, dev0]] + ([[dev0, dev1]] if dev1 != dev0 else [])
    sizes = ctx.sizes
    with ctx.bar(3, "sanitizers") as bar:
        checks = [csan(layouts, sizes.sanitizer_timeout_s, ctx.scratch / "csan.log")]
        bar.update(1)
        for graphs, log in ((False, "memcheck.log"), (True, "memcheck-graphed.log")):
            checks.append(
                memcheck([dev0, dev0], sizes.memcheck_timeout_s, ctx.scratch / log, graphs)
            )
            bar.update(1)
    logs = ("csan.log", "memcheck.log", "memcheck-graphed.log")
    files = [f for f in logs if (ctx.scratch / f).exists()]
    races = int(checks[0].data.get("races", 0))
    mem, graphed = checks[1], checks[2]
    # A CSAN run that timed out or crashed counted no races: it checked nothing.
    counted = checks[0].status == PASS or races
    figure = f"{races} race reports under CSAN" if counted else f"CSAN: {checks[0].detail}"
    figure += "; memcheck: "
    figure += mem.detail if mem.status != SKIP else "SKIP"
    figure += "; graphed stages: " + (graphed.detail if graphed.status != SKIP else "SKIP")
    status = overall(checks)
    reason = next((f"{c.name}: {c.detail}" for c in checks if c.status == FAIL), "")
    if not reason and mem.status == SKIP:
        reason = f"memcheck skipped: {mem.detail}"
    elif not reason and graphed.status == SKIP:
        reason = f"memcheck of graphed stages skipped: {graphed.detail}"
    return StepResult("races", "Races", status, figure, reason, checks, {}, files)

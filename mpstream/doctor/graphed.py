"""Doctor step 7, graphed stages per schedule: eager, graphed, captured, side by side.

On a GPU, after the host-bound analysis, the tutorial's split trains at the
main split size with each schedule the two stages' devices allow
four ways, one after the other in one run: its own ``train_step`` issued
eagerly, the same with every stage replayed from CUDA graphs
(``Pipe(graphs=True)``), the whole step captured as one graph
(:class:`~mpstream.CapturedStep`, which needs both halves on one GPU), and
:class:`~mpstream.CapturedStep` over the graphed stages (their graphs, plus
the zeroing and SGD's update captured per device: how a step across GPUs
is captured), with its graph launches per step. The single
device is measured eagerly and captured, as the like-with-like baseline.
Each measurement is the host's issue time and the step's time (medians, SGD
inside the step), the peak memory of that variant alone
(``max_memory_reserved``, which holds graph pools, with
``max_memory_allocated`` beside) and, for graphed stages, what their
graphs' pools hold, what static buffers (inputs, outputs and their
gradients) the graphs hold outside the pools, and how many slots each
stage keeps; for the step captured as one graph, its pool and the static
input and target buffers it holds outside it
(:attr:`~mpstream.CapturedStep.static_bytes`).

A measurement that raises (a capture error) fails its schedule's line and
leaves the others. So does a failed ``torch.cuda.empty_cache`` between
measurements (an allocator left believing a capture is underway): it is
reported in the row (``cache``) and fails the line, and the next
measurement still runs. The graphed-stages issues' targets are reported,
never failed (a timing is not a defect): graphed stages at most
:data:`OVER_CAPTURED` times the captured step and :data:`OVER_EAGER` times
the eager one, the host issuing for at most :data:`HOST_SHARE` of the step
and at most :data:`HOST_PER_TASK_US` per replayed task (a stage's forward,
backward or weight pass of one micro-batch), the graphs' pools with their
static buffers at most :data:`POOLS_OVER_EAGER` times the eager step's
peak memory.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..capture import CapturedStep
from ..pipe import Pipe
from ..runtime import synchronize
from ..schedules import SCHEDULES, Kind
from ..tutorial import models as tutorial
from ..tutorial.analysis import batch
from .checks import fits, virtual_stages
from .diagnosis import FAIL, PASS, Check, Context
from .experiment import config_for

__all__ = [
    "OVER_CAPTURED",
    "OVER_EAGER",
    "HOST_SHARE",
    "HOST_PER_TASK_US",
    "POOLS_OVER_EAGER",
    "EAGER",
    "GRAPHED",
    "CAPTURED",
    "GRAPHED_STEP",
    "VARIANTS",
    "SINGLE",
    "time_steps",
    "measure",
    "schedule_rows",
    "schedule_checks",
]

OVER_CAPTURED = 1.15
OVER_EAGER = 0.3
HOST_SHARE = 0.10
HOST_PER_TASK_US = 50.0
POOLS_OVER_EAGER = 1.25

EAGER, GRAPHED, CAPTURED = "eager", "graphed stages", "captured step"
GRAPHED_STEP = "captured over graphed stages"
VARIANTS = (EAGER, GRAPHED, CAPTURED, GRAPHED_STEP)
#: The row of the single device (one stage, one micro-batch).
SINGLE = "single device"


def time_steps(
    step: Callable[[], None], devices: Sequence[torch.device], n: int
) -> dict[str, float]:
    """Medians over ``n`` calls of ``step``: the host's time to issue it
    (until the call returns) and the step's (until the devices are done)."""
    issue, wall = [], []
    for _ in range(n):
        synchronize(devices)
        start = time.perf_counter()
        step()
        issued = time.perf_counter()
        synchronize(devices)
        issue.append((issued - start) * 1e3)
        wall.append((time.perf_counter() - start) * 1e3)
    issue_ms, step_ms = statistics.median(issue), statistics.median(wall)
    return {"issue_ms": issue_ms, "step_ms": step_ms, "issue_share": issue_ms / step_ms}


def _pipe(ctx: Context, schedule: str | None, graphs: Any) -> Pipe:
    """The tutorial's split for ``schedule``; None: the single device."""
    config = config_for(ctx)
    dev0, dev1 = ctx.devices
    torch.manual_seed(0)
    if schedule is None:
        model = tutorial.single_device(ctx.arch, dev0, config.num_classes)
        layers = tutorial.resnet50_layers(model)  # type: ignore[arg-type]
        return Pipe(layers, chunks=1, balance=[len(layers)], devices=[dev0], graphs=graphs)
    return tutorial.block_pipe(
        ctx.arch,
        dev0,
        dev1,
        config.split_size,
        config.num_classes,
        schedule=schedule,
        virtual_stages=virtual_stages(schedule, ctx.devices),
        force_copies=ctx.cuda and dev0 == dev1,
        graphs=graphs,
    )


def _step(
    pipe: Pipe, variant: str, x: Tensor, y: Tensor
) -> tuple[Callable[[], None], int, CapturedStep | None]:
    """One training step with SGD: ``train_step``, or the captured step
    (one graph, or over the pipe's graphed stages); its graph launches per
    step; and the captured step, if it is one."""
    loss_fn = nn.MSELoss()
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    if variant in (CAPTURED, GRAPHED_STEP):
        whole = CapturedStep(pipe, x, y, loss_fn, optimizer=opt)

        def replay() -> None:
            whole(x, y)

        return replay, whole.launches, whole

    def eager() -> None:
        opt.zero_grad(set_to_none=False)
        pipe.train_step(x, y, loss_fn)
        opt.step()

    return eager, 0, None


def measure(
    ctx: Context, schedule: str | None, variant: str, backend: Any = True
) -> dict[str, Any] | None:
    """One schedule (None: the single device) trained one way.

    Args:
        ctx: the doctor's context (devices, sizes, model).
        schedule: the pipe's schedule, or None for the single device.
        variant: :data:`EAGER`, :data:`GRAPHED`, :data:`CAPTURED` or
            :data:`GRAPHED_STEP`.
        backend: what ``graphs=`` gets for :data:`GRAPHED` and
            :data:`GRAPHED_STEP` (tests give an emulation).

    Returns:
        The timings, peak memory and, for graphed stages, the graphs'
        report; None where the variant cannot run (a captured step over
        two GPUs).
    """
    if variant == CAPTURED and ctx.cuda and len(set(ctx.devices)) > 1 and schedule is not None:
        return None  # CapturedStep needs one device (see its docstring)
    config = config_for(ctx)
    base: dict[torch.device, tuple[int, int]] = {}
    cache: list[str] = []
    if ctx.cuda:  # what other steps still hold is not this variant's
        _empty_cache("before", cache)
        for d in dict.fromkeys(ctx.devices):
            base[d] = (torch.cuda.memory_reserved(d), torch.cuda.memory_allocated(d))
    pipe = _pipe(ctx, schedule, backend if variant in (GRAPHED, GRAPHED_STEP) else False)
    x, y = batch(config, pipe.devices[0])
    y = y.to(pipe.devices[-1])
    step, launches, whole = _step(pipe, variant, x, y)
    devices = list(dict.fromkeys(pipe.devices))
    for _ in range(2):  # capture (graphed stages), then a replay
        step()
    if ctx.cuda:  # steady state: warm-up's cached blocks go, graph pools stay
        synchronize(devices)
        _empty_cache("after capture", cache)
        for d in devices:
            torch.cuda.reset_peak_memory_stats(d)
    row: dict[str, Any] = time_steps(step, devices, ctx.sizes.profile_steps)
    row["launches"] = launches
    # A replay allocates nothing: what its graphs use sits in their pools,
    # which the allocator reserves. Reserved memory is therefore the figure
    # that compares eager and graphed steps; allocated is kept beside. Both
    # count from what was there before this variant's pipe was built.
    row["peak_reserved_bytes"] = row["peak_allocated_bytes"] = None
    if ctx.cuda:
        row["peak_reserved_bytes"] = {
            str(d): torch.cuda.max_memory_reserved(d) - base[d][0] for d in devices
        }
        row["peak_allocated_bytes"] = {
            str(d): torch.cuda.max_memory_allocated(d) - base[d][1] for d in devices
        }
    if variant == GRAPHED:
        report = pipe.graph_report()
        row["graphed"] = all(s.graphed for s in report.stages)
        row["reasons"] = [s.reason for s in report.stages if s.reason]
        row["slots"] = [s.slots for s in report.stages]
        row["passes"] = [list(s.passes) for s in report.stages]
        row["pool_bytes"] = sum(s.reserved_bytes for s in report.stages)
        row["static_bytes"] = sum(s.static_bytes for s in report.stages)
        row["grad_bytes"] = sum(s.grad_bytes for s in report.stages)
        row["replayed_tasks"] = _replayed(pipe, x, y)
        row["host_us_per_task"] = 1e3 * row["issue_ms"] / max(1, row["replayed_tasks"])
    if variant == CAPTURED and whole is not None:
        row["pool_bytes"] = whole.reserved_bytes
        row["static_bytes"] = whole.static_bytes
    del step, pipe, whole
    if ctx.cuda:
        _empty_cache("after", cache)
    if cache:
        row["cache"] = cache
    return row


def _replayed(pipe: Pipe, x: Tensor, y: Tensor) -> int:
    """Tasks of one training step that replay graphs: every stage's forward,
    backward and (split schedules) weight pass of every micro-batch."""
    size = pipe.split_size
    micros = -(-len(x) // size) if size else min(pipe.chunks or 1, len(x))
    schedule = pipe.schedule_for(micros, x.device, training_step=True, target_device=y.device)
    passes = (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)
    return sum(1 for t in schedule.tasks if t.kind in passes)


def _empty_cache(when: str, failures: list[str]) -> None:
    """Collects garbage and empties the CUDA cache; a failure is appended
    to ``failures`` (named by ``when``) instead of raised: the measurements
    after it still run, and the line reports it."""
    gc.collect()
    try:
        torch.cuda.empty_cache()
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        failures.append(f"empty_cache {when}: {type(exc).__name__}: {first}")


def schedule_rows(
    ctx: Context,
    backend: Any = True,
    schedules: Sequence[str] = SCHEDULES,
    tick: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """The single device, then each schedule: eager, graphed, captured, captured
    over graphed stages (a measurement that raised holds its ``error`` instead)."""
    rows = []
    for schedule in [None, *[s for s in schedules if fits(s, ctx.devices)]]:
        row: dict[str, Any] = {"schedule": schedule or SINGLE}
        variants = (EAGER, CAPTURED) if schedule is None else VARIANTS
        for variant in variants:
            try:
                row[variant] = measure(ctx, schedule, variant, backend)
            except Exception as exc:  # one failed measurement must not lose the others
                first = (str(exc).strip().splitlines() or [""])[0]
                row[variant] = {"error": f"{type(exc).__name__}: {first}"}
            failed = row[variant]
            if ctx.cuda and failed is not None and "error" in failed:
                cache: list[str] = []
                _empty_cache("after the error", cache)  # the failed pipe, freed with it
                if cache:
                    failed["cache"] = cache
            if tick is not None:
                tick()
        rows.append(row)
    return rows


def _mib(row: dict[str, Any] | None, key: str = "peak_reserved_bytes") -> str:
    if row is None or row.get(key) is None:
        return "-"
    value = row[key]
    total = sum(value.values()) if isinstance(value, dict) else value
    return f"{total / 2**20:.0f} MiB"


def _held(captured: dict[str, Any] | None) -> str:
    """What a step captured as one graph holds beyond an eager step's: its
    pool and its input and target buffers (empty where not measured)."""
    if captured is None or "static_bytes" not in captured:
        return ""
    pool, static = _mib(captured, "pool_bytes"), _mib(captured, "static_bytes")
    return f": its graph's pool {pool} and input and target buffers outside it {static}"


def _total(value: dict[str, int] | int | None) -> int:
    """Bytes over devices (a per-device dict), or as given."""
    return sum(value.values()) if isinstance(value, dict) else int(value or 0)


def _against(value: float, bound: float, what: str, cuda: bool) -> str:
    met = ("met" if value <= bound else "missed") if cuda else "a GPU target"
    return f"{value:.2f}x {what} (target <= {bound}x: {met})"


def schedule_checks(rows: Sequence[dict[str, Any]], cuda: bool, split: int) -> list[Check]:
    """One line per schedule with its figures against the targets."""
    single = next(r for r in rows if r["schedule"] == SINGLE)
    base = _ok(single[CAPTURED])
    checks = [_single_check(single)]
    for row in rows:
        if row["schedule"] == SINGLE:
            continue
        name = f"graphed stages, {row['schedule']}, split {split}"
        eager, graphed, captured = _ok(row[EAGER]), _ok(row[GRAPHED]), _ok(row[CAPTURED])
        failed = [f"{v}: {row[v]['error']}" for v in VARIANTS if (row.get(v) or {}).get("error")]
        failed += _cache_failures(row, VARIANTS)
        if eager is None or graphed is None:
            checks.append(Check(name, FAIL, "; ".join(failed), row))
            continue
        step = graphed["step_ms"]
        parts = [f"step {step:.1f} ms (eager {eager['step_ms']:.1f} ms)"]
        if captured is not None:
            over = step / captured["step_ms"]
            parts.append(_against(over, OVER_CAPTURED, "the captured step", cuda))
        around = _ok(row.get(GRAPHED_STEP))
        if captured is not None and around is not None:
            ratio = around["step_ms"] / captured["step_ms"]
            parts.append(
                f"captured over graphed stages {around['step_ms']:.1f} ms in "
                f"{around.get('launches')} launches ({ratio:.2f}x one graph)"
            )
        parts.append(_against(step / eager["step_ms"], OVER_EAGER, "eager", cuda))
        share = graphed["issue_share"]
        met = ("met" if share <= HOST_SHARE else "missed") if cuda else "a GPU target"
        bound = f"{100 * HOST_SHARE:.0f}%"
        parts.append(f"host issue {100 * share:.0f}% of the step (target <= {bound}: {met})")
        per_task = graphed.get("host_us_per_task")
        if per_task is not None:
            met = ("met" if per_task <= HOST_PER_TASK_US else "missed") if cuda else "a GPU target"
            parts.append(
                f"host {per_task:.0f} us per replayed task over {graphed['replayed_tasks']} "
                f"(target <= {HOST_PER_TASK_US:.0f} us: {met})"
            )
        if base is not None:
            parts.append(f"{step / base['step_ms']:.2f}x the single device captured")
        parts.append(
            f"memory reserved at peak {_mib(graphed)} (eager {_mib(eager)}, captured "
            f"{_mib(captured)}{_held(captured)}), of which graph pools "
            f"{_mib(graphed, 'pool_bytes')} and "
            f"static buffers outside them {_mib(graphed, 'static_bytes')}; "
            f"slots {graphed['slots']}"
        )
        peak = _total(eager.get("peak_reserved_bytes"))
        if peak:
            over = (graphed["pool_bytes"] + graphed["static_bytes"]) / peak
            what = "the eager peak in graph pools and static buffers"
            parts.append(_against(over, POOLS_OVER_EAGER, what, cuda))
        if not graphed["graphed"]:  # a stage fell back: these are not graphed figures
            failed.append(f"EAGER STAGES: {'; '.join(graphed['reasons'])}")
        parts.extend(failed)
        checks.append(Check(name, FAIL if failed else PASS, "; ".join(parts), row))
    return checks


def _single_check(single: dict[str, Any]) -> Check:
    """The single device's line: the baseline the schedules are held against."""
    name = "graphed stages' baseline: the single device"
    failed = [f"{v}: {single[v]['error']}" for v in (EAGER, CAPTURED) if "error" in single[v]]
    failed += _cache_failures(single, (EAGER, CAPTURED))
    if failed:
        return Check(name, FAIL, "; ".join(failed), single)
    eager, whole = single[EAGER], single[CAPTURED]
    detail = (
        f"step {eager['step_ms']:.1f} ms eager (host issue {100 * eager['issue_share']:.0f}%), "
        f"{whole['step_ms']:.1f} ms captured as one graph; memory reserved at peak "
        f"{_mib(eager)} eager, {_mib(whole)} captured{_held(whole)}"
    )
    return Check(name, PASS, detail, single)


def _cache_failures(row: dict[str, Any], variants: Sequence[str]) -> list[str]:
    """The row's failed ``empty_cache`` calls, named by variant."""
    return [f"{v}: {c}" for v in variants for c in (row.get(v) or {}).get("cache", [])]


def _ok(measured: dict[str, Any] | None) -> dict[str, Any] | None:
    """A measurement, or None where it could not run or raised."""
    return None if measured is None or "error" in measured else measured

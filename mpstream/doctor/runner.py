"""``mpstream doctor``: proves on this machine's devices that the pipeline is right and overlaps.

Eight steps run in order (:data:`STEPS`): environment, correctness, overlap,
races, memory, the tutorial's experiment, where the time goes, and the cost
model. Each prints one line as it finishes (PASS / FAIL / SKIP, the key
figure or the reason); a failing step does not stop the others; steps that
measure CUDA streams SKIP without a GPU. A summary table comes last and the
report (:mod:`mpstream.doctor.report`) is written into ``--out``. The exit code is
1 if any step failed.
"""

from __future__ import annotations

import dataclasses
import datetime
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..tutorial.bench import detect_devices
from ..tutorial.models import IDRIS_SPLIT_SIZE
from ..workloads import transformer as workload
from . import (
    attribution,
    checks,
    environment,
    experiment,
    modelcheck,
    probes,
    report,
    sanitizer,
    soak,
    transformer_checks,
    transformer_costs,
)
from . import transformer as on_transformer
from .diagnosis import FAIL, FULL, QUICK, SKIP, Context, Sizes, StepResult, jsonable

__all__ = [
    "Step",
    "STEPS",
    "TRANSFORMER_STEPS",
    "SKIPPABLE",
    "WORKLOAD_STEPS",
    "steps_for",
    "NAMES",
    "ARCHS",
    "Options",
    "sized",
    "run_step",
    "run",
]


@dataclass(frozen=True)
class Step:
    """One doctor step.

    Attributes:
        name: the name ``--skip`` takes.
        title: the human title.
        run: the step itself.
        needs_cuda: SKIP without a CUDA device.
        needs: keys of :attr:`Context.shared` earlier steps must have left.
    """

    name: str
    title: str
    run: Callable[[Context], StepResult]
    needs_cuda: bool = False
    needs: tuple[str, ...] = ()


STEPS = (
    Step("environment", "Environment", environment.run),
    Step("correctness", "Correctness", checks.run),
    Step("overlap", "Overlap", probes.run, needs_cuda=True),
    Step("races", "Races", sanitizer.run, needs_cuda=True),
    Step("memory", "Memory", soak.run, needs_cuda=True),
    Step("tutorial", "Tutorial experiment", experiment.run),
    Step("profile", "Where the time goes", attribution.run),
    Step("cost-model", "Cost model", modelcheck.run, needs=("profiles",)),
)
#: ``--model transformer``: the same proof on the transformer workload.
TRANSFORMER_STEPS = (
    Step("environment", "Environment", environment.run),
    Step("correctness", "Correctness", transformer_checks.correctness),
    Step("overlap", "Overlap", probes.run, needs_cuda=True),
    Step("races", "Races", transformer_checks.races, needs_cuda=True),
    Step("memory", "Memory", on_transformer.memory_step),
    Step("experiment", "Experiment", on_transformer.experiment),
    Step("profile", "Where the time goes", on_transformer.profile_step),
    Step("cost-model", "Cost model", transformer_costs.cost_model, needs=("transformer_profile",)),
)
NAMES = tuple(s.name for s in STEPS)
#: The steps the experiment's workload (--image-size, --batch-size, --split-sizes) sizes.
WORKLOAD_STEPS = ("tutorial", "profile", "cost-model")
#: What ``--skip`` takes, whatever the model.
SKIPPABLE = tuple(dict.fromkeys(s.name for s in (*STEPS, *TRANSFORMER_STEPS)))
ARCHS = ("resnet50", "resnet101", "transformer")

# Why a step needs what it needs, for its SKIP line.
_WHY_CUDA = {
    "overlap": "measures CUDA streams overlapping",
    "races": "runs the CUDA sanitizers",
    "memory": "reads the CUDA allocator's statistics",
}
_WHY_NEEDS = {
    "profiles": "fitted from step 7's profile, which did not run",
    "transformer_profile": "fitted from step 7's profile, which did not run",
}


@dataclass
class Options:
    """What ``mpstream doctor`` was asked to do.

    Attributes:
        out: the report folder.
        devices: ``'cuda:0'`` or ``'cuda:0,cuda:1'`` (default: detected).
        quick: the CPU-sized run (automatic without a GPU).
        arch: ``'resnet50'`` or ``'resnet101'`` for the tutorial's
            experiment; ``'transformer'`` for :data:`TRANSFORMER_STEPS`.
        preset: the transformer's preset (default: 1b at the full sizes,
            tiny otherwise).
        skip: names of steps not to run.
        progress: progress bars (still only on a terminal).
        sizes: explicit sizes, overriding ``quick`` (tests use the tiny ones).
        command: the command line, for the report.
        image_size: the experiment's images, ``(W, H)`` (default: the sizes').
        batch_size: the experiment's images per step (default: the sizes').
        split_sizes: the experiment's split sizes, the first the main one
            (default: the sizes' that fit the batch).
    """

    out: Path
    devices: str | None = None
    quick: bool = False
    arch: str = "resnet50"
    preset: str | None = None
    skip: tuple[str, ...] = ()
    progress: bool = True
    sizes: Sizes | None = None
    command: str = "mpstream doctor"
    image_size: tuple[int, int] | None = None
    batch_size: int | None = None
    split_sizes: tuple[int, ...] | None = None


def sized(sizes: Sizes, options: Options) -> Sizes:
    """``sizes`` with the experiment (steps 6-8) at ``options``' workload.

    Raises:
        ValueError: images under 32x32, or split sizes that do not fit the batch.
    """
    config = sizes.experiment
    if options.image_size is not None:
        w, h = options.image_size
        if w < 32 or h < 32:
            raise ValueError(
                f"--image-size {w}x{h}: must be at least 32x32 (the ResNets downsample 32x)"
            )
        config = dataclasses.replace(config, image_w=w, image_h=h)
    batch = options.batch_size or config.batch_size
    if options.split_sizes is not None:
        splits = options.split_sizes
        over = [s for s in splits if s > batch]
        if over:
            raise ValueError(
                f"--split-sizes {', '.join(map(str, over))}: larger than the batch of {batch} "
                "images (--batch-size)"
            )
    else:
        splits = tuple(s for s in config.split_sizes if s <= batch)
        if options.arch == "resnet101" and IDRIS_SPLIT_SIZE <= batch:
            # IDRIS's variant, at its own split size: the main one (a split
            # as large as the batch fits, like any other split size).
            splits = (IDRIS_SPLIT_SIZE, *sorted({*splits} - {IDRIS_SPLIT_SIZE}))
        if not splits:
            raise ValueError(
                f"--batch-size {batch} is below every split size of the experiment "
                f"({', '.join(map(str, config.split_sizes))}); give --split-sizes too"
            )
    config = dataclasses.replace(config, batch_size=batch, split_sizes=splits, split_size=splits[0])
    return dataclasses.replace(sizes, experiment=config)


def _workload(options: Options) -> str:
    """The command's workload options, for the first line (empty without any)."""
    parts = []
    if options.image_size is not None:
        parts.append("{}x{} images".format(*options.image_size))
    if options.batch_size is not None:
        parts.append(f"batch {options.batch_size}")
    if options.split_sizes is not None:
        parts.append(f"split sizes {', '.join(map(str, options.split_sizes))}")
    return f" (experiment: {', '.join(parts)})" if parts else ""


def run_step(step: Step, ctx: Context, skip: Sequence[str]) -> StepResult:
    """Runs one step; an exception becomes a FAIL with its message, never a crash."""
    if step.name in skip:
        return StepResult(step.name, step.title, SKIP, reason="skipped with --skip")
    if step.needs_cuda and not ctx.cuda:
        where = ", ".join(str(d) for d in ctx.devices)
        why = _WHY_CUDA.get(step.name, "needs CUDA")
        return StepResult(step.name, step.title, SKIP, reason=f"no CUDA device ({where}): {why}")
    missing = [k for k in step.needs if k not in ctx.shared]
    if missing:
        return StepResult(step.name, step.title, SKIP, reason=_WHY_NEEDS[missing[0]])
    start = time.perf_counter()
    try:
        result = step.run(ctx)
    except Exception as exc:  # one broken step must not hide the others' findings
        (ctx.scratch / f"{step.name}.traceback.txt").write_text(traceback.format_exc())
        first = (str(exc).strip().splitlines() or [""])[0]
        result = StepResult(
            step.name,
            step.title,
            FAIL,
            reason=f"{type(exc).__name__}: {first}",
            files=[f"{step.name}.traceback.txt"],
        )
    result.seconds = time.perf_counter() - start
    return result


def steps_for(arch: str) -> tuple[Step, ...]:
    """The steps of a run on ``arch``."""
    return TRANSFORMER_STEPS if arch == "transformer" else STEPS


def _line(i: int, total: int, result: StepResult) -> str:
    text = result.figure if result.figure and result.status != SKIP else result.reason
    if result.status == FAIL and result.figure and result.reason:
        text = f"{result.figure} | {result.reason}"
    head = f"[{i}/{total}] {result.title:<22} {result.status:<4}"
    return f"{head}  {text}  ({result.seconds:.1f} s)"


def check(options: Options) -> tuple[tuple[torch.device, torch.device], Sizes, str, str]:
    """Refuses bad options before anything runs.

    Returns:
        The devices, the sizes and their label (quick, full or custom), and
        the transformer's preset.

    Raises:
        ValueError: bad devices, architecture, step names or sizes.
    """
    if options.arch not in ARCHS:
        raise ValueError(f"unknown model {options.arch!r}; valid: {', '.join(ARCHS)}")
    names = [s.name for s in steps_for(options.arch)]
    unknown = [s for s in options.skip if s not in names]
    if unknown:
        raise ValueError(
            f"unknown step(s) {', '.join(unknown)} for {options.arch}; steps: {', '.join(names)}"
        )
    transformer = options.arch == "transformer"
    given = [o for o in ("image_size", "batch_size", "split_sizes") if getattr(options, o)]
    if transformer and given:
        flags = ", ".join(f"--{o.replace('_', '-')}" for o in given)
        raise ValueError(f"{flags}: the tutorial's experiment's; the transformer takes --preset")
    if options.preset is not None and not transformer:
        raise ValueError("--preset sizes the transformer: give --model transformer too")
    if given and set(WORKLOAD_STEPS) <= set(options.skip):
        flags = ", ".join(f"--{o.replace('_', '-')}" for o in given)
        raise ValueError(
            f"{flags}: size steps 6-8 ({', '.join(WORKLOAD_STEPS)}), which --skip skips "
            "all of; drop them, or run one of those steps"
        )
    devices = detect_devices(options.devices)
    if options.sizes is not None:
        sizes, label = options.sizes, "custom"
    elif options.quick or devices[0].type != "cuda":
        sizes, label = QUICK, "quick"
    else:
        sizes, label = FULL, "full"
    sizes = sized(sizes, options)
    preset = options.preset or ("1b" if label == "full" else "tiny")
    if transformer:
        workload.preset(preset)  # an unknown name fails here, not in a step
    return devices, sizes, label, preset


def run(options: Options, echo: Callable[[str], None] | None = None) -> int:
    """Runs every step, prints a line per step and the table, writes the report.

    Args:
        options: what to run and where to write.
        echo: where console lines go (default: stdout, flushed).

    Returns:
        The exit status: 0 if no step failed, 1 otherwise.

    Raises:
        ValueError: bad options (:func:`check`).
    """
    devices, sizes, label, preset = check(options)
    steps = steps_for(options.arch)
    transformer = options.arch == "transformer"
    cuda = devices[0].type == "cuda"
    log: list[str] = []

    def say(text: str) -> None:
        log.append(text)
        (echo or (lambda t: print(t, flush=True)))(text)

    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in report.ARTIFACTS:  # a rerun must not leave an older run's files behind
        (out / name).unlink(missing_ok=True)
    where = " | ".join(str(d) for d in devices)
    model = f"transformer {preset}" if transformer else options.arch
    say(
        f"mpstream doctor: {where}, {model}, {label} sizes{_workload(options)}"
        + ("" if cuda or options.quick else " (no CUDA device: the quick sizes)")
        + f"; report in {out}"
    )
    started = time.perf_counter()
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix="mpstream-doctor-") as tmp:
        ctx = Context(devices, sizes, options.arch, out, Path(tmp), options.progress)
        ctx.shared["preset"] = preset
        results: list[StepResult] = []
        collected: dict[str, Any] = {}

        def meta(partial: str | None) -> dict[str, Any]:
            env = ctx.shared.get("environment")
            if env is None:  # the environment step was skipped: collected once
                if "env" not in collected:
                    collected["env"] = environment.collect(devices)
                env = collected["env"]
            return {
                "format": "mpstream-doctor/1",
                "command": options.command,
                "created": created,
                "devices": [str(d) for d in devices],
                "arch": options.arch,
                "preset": preset if transformer else None,
                "sizes": label,
                "size_values": jsonable(sizes),
                "skipped": list(options.skip),
                "total_seconds": time.perf_counter() - started,
                "partial": partial,
                "environment": env,
            }

        for i, step in enumerate(steps, 1):
            results.append(run_step(step, ctx, options.skip))
            say(_line(i, len(steps), results[-1]))
            if i < len(steps) and step.name not in options.skip:
                # Written after every step that ran, so that a run stopped
                # by a time limit (a GPU lease) still leaves what it found.
                (ctx.scratch / "doctor.log").write_text("\n".join(log) + "\n")
                partial = f"written after step {i} of {len(steps)}; a later report replaces it"
                report.write(out, ctx.scratch, results, meta(partial))
        final = meta(None)
        say(
            f"report in {out}: {', '.join(report.top_files(out))} "
            f"({final['total_seconds']:.0f} s in all)"
        )
        say(report.table(results))
        (ctx.scratch / "doctor.log").write_text("\n".join(log) + "\n")
        report.write(out, ctx.scratch, results, final)
    return 1 if report.status_of(results) == FAIL else 0

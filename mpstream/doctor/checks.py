"""Doctor step 2: results equal the single-device CPU model, and every event plan is sound.

The grid: a float64 chain of three stages on each device layout (all on one
GPU; the same with ``force_copies``; across two GPUs when present; on the CPU
without a GPU), fed from pageable host memory, pinned host memory and the
device, through ``pipe(x)`` + ``backward`` for each checkpoint mode and
``train_step`` for each schedule x checkpoint mode. Each case compares the
output (or loss) and every gradient with ``torch.testing.assert_close``
against the plain model on the CPU. The tutorial's ResNet (train mode, so
BatchNorm sees each micro-batch) is compared with torchvision's model run
on the same micro-batches. The plan checks record the scheduler's stream
operations for a grid of layouts without any device and verify them.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..memory import CHECKPOINT_MODES
from ..pipe import Pipe
from ..runtime import PlanError, record_plan, verify_plan
from ..schedules import SCHEDULES, placement_of, virtual_stages_for
from ..tutorial import models as tutorial
from .diagnosis import FAIL, PASS, Check, Context, StepResult, overall

__all__ = [
    "Case",
    "cases",
    "layouts",
    "named",
    "run_case",
    "resnet_case",
    "summarize",
    "plan_grid",
    "run",
]

WIDTHS = (16, 32, 32, 16, 8)  # four Linear+Tanh pairs: 8 layers
BALANCE = [3, 3, 2]
BATCH, SPLIT = 10, 3  # micro-batches of 3, 3, 3 and 1


def chain() -> nn.Sequential:
    """The float64 chain every case pipelines."""
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers).double()


@dataclass(frozen=True)
class Case:
    """One cell of the grid.

    Attributes:
        layout: a label for the device layout.
        devices: the device of each stage.
        force: ``force_copies``.
        source: where the batch sits: ``'pageable'``, ``'pinned'``, ``'device'``.
        mode: ``'forward'`` (``pipe(x)`` + ``backward``) or a schedule's name
            (``train_step``).
        checkpoint: the checkpoint mode.
    """

    layout: str
    devices: tuple[torch.device, ...]
    force: bool
    source: str
    mode: str
    checkpoint: str

    @property
    def name(self) -> str:
        how = "pipe(x)+backward" if self.mode == "forward" else f"train_step {self.mode}"
        return f"{self.layout}, {self.source} input, {how}, checkpoint {self.checkpoint}"


def layouts(
    devices: tuple[torch.device, torch.device],
) -> list[tuple[str, list[torch.device], bool]]:
    """The device layouts of the grid for the doctor's devices."""
    dev0, dev1 = devices
    if dev0.type != "cuda":
        return [(f"3 stages on {dev0}", [dev0] * 3, False)]
    out = [
        (f"3 stages on {dev0}", [dev0] * 3, False),
        (f"3 stages on {dev0}, forced copies", [dev0] * 3, True),
    ]
    if dev1 != dev0:
        out.append((f"{dev0} | {dev1} | {dev1}", [dev0, dev1, dev1], False))
    return out


def virtual_stages(mode: str, devices: Sequence[object]) -> int | None:
    """``virtual_stages`` for a schedule of several stages per rank when
    every stage shares one device (a round-robin one: one rank holds them
    all; a V: two per rank); None otherwise."""
    if len(set(devices)) == 1:
        return {"round_robin": len(devices), "v": 2}.get(placement_of(mode))
    return None


def fits(mode: str, devices: Sequence[Hashable]) -> bool:
    """Whether ``mode`` (a schedule, or ``'forward'``) runs on stages
    placed on ``devices`` (with :func:`virtual_stages`): a V needs an even
    number of stages mirrored over the devices, round-robin a repeating
    list."""
    if mode == "forward":
        return True
    try:
        virtual_stages_for(mode, devices, virtual_stages(mode, devices))
    except ValueError:
        return False
    return True


def placed(schedule: str, stages: int, devices: Sequence[Any]) -> list[Any]:
    """``stages`` stages over ``devices`` as ``schedule`` places them:
    round-robin, in a V (ranks in contiguous runs over the devices), or
    contiguous runs."""
    n = len(devices)
    kind = placement_of(schedule)
    if kind == "round_robin":
        return [devices[s % n] for s in range(stages)]
    if kind == "v":
        ranks = max(stages // 2, 1)
        return [devices[min(s, stages - 1 - s) * n // ranks % n] for s in range(stages)]
    return [devices[s * n // stages] for s in range(stages)]


def cases(devices: tuple[torch.device, torch.device]) -> list[Case]:
    """Every case of the grid, in order."""
    out = []
    for label, devs, force in layouts(devices):
        # Host and device memory are the same thing on a CPU layout.
        sources = ("pageable", "pinned", "device") if devs[0].type == "cuda" else ("device",)
        # The round-robin and V schedules need their placements: on one
        # device, virtual_stages gives it (a V an even number of stages).
        modes = ("forward", *[m for m in SCHEDULES if fits(m, devs)])
        for mode, source, checkpoint in itertools.product(modes, sources, CHECKPOINT_MODES):
            out.append(Case(label, tuple(devs), force, source, mode, checkpoint))
    return out


def _placed(x: Tensor, source: str, device: torch.device) -> Tensor:
    """A fresh copy of ``x`` where ``source`` says (never ``x`` itself)."""
    if source == "pinned":
        return x.pin_memory()
    return x.to(device, copy=True) if source == "device" else x.clone()


def named(name: str) -> Callable[[str], str]:
    """An ``assert_close`` message that starts with what was compared."""
    return lambda message: f"{name}: {message}"


def _compare_grads(pipe: nn.Module, ref: nn.Module) -> None:
    for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
        assert a.grad is not None, f"no gradient for {name}"
        torch.testing.assert_close(a.grad.cpu(), b.grad, msg=named(name))


def run_case(case: Case) -> None:
    """Runs one case; raises AssertionError (from assert_close) on any difference."""
    model = chain()
    ref = copy.deepcopy(model)
    pipe = Pipe(
        copy.deepcopy(model),
        split_size=SPLIT,
        balance=BALANCE,
        devices=list(case.devices),
        checkpoint=case.checkpoint,
        schedule="gpipe" if case.mode == "forward" else case.mode,
        force_copies=case.force,
        virtual_stages=virtual_stages(case.mode, case.devices),
    )
    x = torch.randn(BATCH, WIDTHS[0], dtype=torch.float64)
    if case.mode == "forward":
        x_pipe = _placed(x, case.source, case.devices[0]).requires_grad_()
        x_ref = x.clone().requires_grad_()
        out = pipe(x_pipe)
        expected = ref(x_ref)
        torch.testing.assert_close(out.cpu(), expected)
        torch.autograd.backward(out.pow(2).sum())
        torch.autograd.backward(expected.pow(2).sum())
        assert x_pipe.grad is not None, "no gradient for the input"
        torch.testing.assert_close(x_pipe.grad.cpu(), x_ref.grad)
    else:
        y = torch.randn(BATCH, WIDTHS[-1], dtype=torch.float64)
        target = _placed(y, case.source, case.devices[-1])
        loss = pipe.train_step(_placed(x, case.source, case.devices[0]), target, nn.MSELoss())
        expected = nn.MSELoss()(ref(x), y)
        torch.autograd.backward(expected)
        torch.testing.assert_close(loss.cpu(), expected.detach())
    _compare_grads(pipe, ref)


def resnet_case(
    arch: str, devices: tuple[torch.device, torch.device], image: int, batch: int
) -> None:
    """The tutorial's split of ``arch`` through mpstream vs torchvision's model, float64.

    Train mode: each micro-batch is normalised on its own, so the reference
    runs the same micro-batches and back-propagates through their
    concatenation. Raises AssertionError on any difference.
    """
    # At least 2 images per micro-batch: a 32x32 image leaves 1x1 maps in
    # layer4, where BatchNorm in train mode needs more than one value.
    split = max(2, batch // 3)
    stream = (
        tutorial.StreamPipelineResNet101 if arch == "resnet101" else tutorial.StreamPipelineResNet50
    )
    model = stream(devices[0], devices[1], split_size=split, num_classes=10).double()
    ref = tutorial.single_device(arch, "cpu", 10).double()
    model.load_state_dict(ref.state_dict(), strict=False)  # seq1/seq2 alias the same modules
    x = torch.randn(batch, 3, image, image, dtype=torch.float64)
    x_pipe, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = model(x_pipe)
    expected = torch.cat([ref(part) for part in torch.split(x_ref, split)])
    torch.testing.assert_close(out.cpu(), expected)
    weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(expected)
    torch.autograd.backward((out * weights.to(out.device)).sum())
    torch.autograd.backward((expected * weights).sum())
    assert x_pipe.grad is not None, "no gradient for the input"
    torch.testing.assert_close(x_pipe.grad, x_ref.grad)
    mine = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(mine[name].grad.cpu(), p.grad, msg=named(name))


def _plans() -> Iterator[tuple[str, dict[str, object]]]:
    """The plan grid: schedules x stages x micro-batches x layouts x transfers."""
    for schedule, stages, chunks in itertools.product(SCHEDULES, (2, 3, 4), (1, 4, 7)):
        one = ["cuda:0"] * stages
        spread = [f"cuda:{s}" for s in range(stages)]
        # Stages share two GPUs as the schedule places them.
        mixed = placed(schedule, stages, ["cuda:0", "cuda:1"])
        for (label, devs), force, host_input in itertools.product(
            (("one GPU", one), ("a GPU per stage", spread), ("mixed", mixed)),
            (False, True),
            (False, True),
        ):
            if not fits(schedule, devs):
                continue  # e.g. a V over an odd number of stages
            backwards = (False, True) if schedule == "gpipe" else (True,)
            for backward in backwards:
                for host_target in (False, True) if backward else (False,):
                    kw: dict[str, object] = {
                        "devices": devs,
                        "input_device": "cpu" if host_input else None,
                        "target_device": "cpu" if host_target else None,
                        "backward": backward,
                        "force_copies": force,
                        "virtual_stages": virtual_stages(schedule, devs),
                    }
                    yield (
                        f"{schedule} {stages}x{chunks} {label}",
                        {
                            "schedule": schedule,
                            "stages": stages,
                            "chunks": chunks,
                            **kw,
                        },
                    )


def plan_grid() -> list[Check]:
    """Records and verifies every plan of the grid; one check per schedule."""
    counts = dict.fromkeys(SCHEDULES, 0)
    problems: dict[str, list[str]] = {s: [] for s in SCHEDULES}
    for label, kw in _plans():
        schedule = str(kw["schedule"])
        counts[schedule] += 1
        try:
            verify_plan(record_plan(**kw))  # type: ignore[arg-type]
        except PlanError as exc:
            # "invalid plan:" heads a list of problems; other plan errors are one line.
            lines = str(exc).strip().splitlines() or ["invalid plan"]
            problems[schedule].append(f"{label} {kw}: {(lines[1:] or lines)[0].strip()}")
    return [
        Check(
            f"event plans, {s}",
            FAIL if problems[s] else PASS,
            f"{counts[s] - len(problems[s])}/{counts[s]} verified"
            + (f"; first: {problems[s][0]}" if problems[s] else ""),
            {"plans": counts[s], "failures": problems[s]},
        )
        for s in SCHEDULES
    ]


def _attempt(fn: Callable[[], None]) -> str | None:
    """None if ``fn`` runs clean, else the first line of what it raised."""
    try:
        fn()
    except AssertionError as exc:
        return (str(exc).strip().splitlines() or ["assertion failed"])[0]
    except Exception as exc:  # a crash is a failed case, reported, not fatal
        return f"{type(exc).__name__}: {exc}"
    return None


def summarize(results: Sequence[tuple[Case, str | None]]) -> list[Check]:
    """One check per layout and way of training: FAIL if any of its cases failed.

    Args:
        results: each case with None (equal) or the first line of its error.
    """
    groups: dict[tuple[str, str], list[tuple[Case, str | None]]] = {}
    for case, error in results:
        how = "pipe(x) + backward" if case.mode == "forward" else "train_step"
        groups.setdefault((case.layout, how), []).append((case, error))
    checks = []
    for (layout, how), members in groups.items():
        failed = [(c, e) for c, e in members if e is not None]
        detail = f"{len(members) - len(failed)}/{len(members)} equal the CPU model"
        if failed:
            detail += f"; first: {failed[0][0].name}: {failed[0][1]}"
        checks.append(Check(f"{layout}: {how}", FAIL if failed else PASS, detail))
    return checks


def run(ctx: Context) -> StepResult:
    """Runs the grid, the ResNet check and the plan checks."""
    grid = cases(ctx.devices)
    results: list[tuple[Case, str | None]] = []
    with ctx.bar(len(grid) + 1, "correctness") as bar:
        for case in grid:
            results.append((case, _attempt(functools.partial(run_case, case))))
            bar.update(1)
        size = ctx.sizes
        resnet = _attempt(
            lambda: resnet_case(ctx.arch, ctx.devices, size.resnet_image, size.resnet_batch)
        )
        bar.update(1)
    checks = summarize(results)
    where = " | ".join(str(d) for d in ctx.devices)
    checks.append(
        Check(
            f"tutorial {ctx.arch} ({where}), train mode",
            FAIL if resnet else PASS,
            resnet or "output and every gradient equal torchvision's model",
        )
    )
    checks += plan_grid()
    passed = sum(e is None for _, e in results) + (resnet is None)
    plans = sum(int(c.data["plans"]) - len(c.data["failures"]) for c in checks if "plans" in c.data)
    figure = (
        f"{passed}/{len(results) + 1} cases equal the CPU model (float64); {plans} plans verified"
    )
    data = {
        "cases": [{"case": c.name, "error": e} for c, e in results],
        "resnet": {"arch": ctx.arch, "error": resnet},
    }
    status = overall(checks)
    reason = next((c.detail for c in checks if c.status == FAIL), "")
    return StepResult(
        "correctness", "Correctness", status, figure, reason, checks=checks, data=data
    )

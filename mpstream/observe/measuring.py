"""What the schedule comparison measures on a real pipe: stage costs, memory, split cost.

:mod:`.compare` simulates the schedules from given costs; these functions
run real training steps (or a stage's backward) instead. :func:`profile_stages`
times each stage's forward, input-gradient and weight-gradient passes apart
(under ``'zb_h1'``); :func:`measure_memory` runs a step per schedule and
records the bytes autograd saved per stage (CPU) and the allocator's peak per
CUDA device; :func:`split_cost` times a stage's split backward (B, then W)
against its plain backward.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from ..memory import StageSavedBytes
from ..pipe import Pipe, micro_sizes, warned_as_before
from ..runtime import GradSink, backward_inputs, cut, synchronize
from ..schedules import SCHEDULES, Order, placement_of
from .fitting import Costs, fit
from .profiling import profile

__all__ = [
    "profile_stages",
    "measure_memory",
    "split_cost",
    "untouched",
    "scheduled",
    "label",
]


def label(schedule: Order) -> str:
    """How results name a schedule: a built-in one by its name, an order of
    actions as ``'your order'`` (not the text of every action)."""
    return schedule if isinstance(schedule, str) and schedule in SCHEDULES else "your order"


@contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Times a user's own model without leaving a trace: its gradients,
    buffers (BatchNorm statistics), the random-number state (CPU and its
    GPUs') and a pipe's once-per-pipe warning are put back afterwards, so
    the next real step's dropout masks do not depend on whether anything
    was measured, and a warning a try used up is still given.

    A gradient that is a view of a larger buffer (a graphed stage's gradient
    store, DDP's bucket views) is the same tensor the timed steps add into,
    so its values are saved too and copied back into it."""
    devices = model.devices if isinstance(model, Pipe) else [t.device for t in _tensors(model)]
    gpus = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    grads = [(p, p.grad) for p in model.parameters()]
    # Only views are copied: a plain .grad set to None is not written again.
    views = [(g, g.detach().clone()) for _, g in grads if g is not None and g._base is not None]
    buffers = [(b, b.detach().clone()) for b in model.buffers() if not is_lazy(b)]
    for p, _ in grads:
        p.grad = None
    warned = warned_as_before(model) if isinstance(model, Pipe) else contextlib.nullcontext()
    try:
        with torch.random.fork_rng(devices=gpus), warned:
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
            for view, value in views:
                view.copy_(value)
        for p, grad in grads:
            p.grad = grad


def _tensors(model: nn.Module) -> Iterator[Tensor]:
    yield from model.parameters()
    yield from model.buffers()


@contextmanager
def scheduled(pipe: Pipe) -> Iterator[None]:
    """Lets measuring steps set ``pipe.schedule`` and ``virtual_stages``:
    both are put back afterwards, and with them what ``schedule='auto'``
    had chosen (setting a schedule forgets it), so the next step does not
    measure to choose again."""
    # Setting a schedule replaces the pipe's choices (pipe/auto.py's
    # Choices): the old object is put back as it was.
    saved = pipe._choices()
    previous = (pipe.schedule, pipe.virtual_stages)
    try:
        yield
    finally:
        pipe.schedule, pipe.virtual_stages = previous
        pipe.__dict__["_auto_choices"] = saved


def _step(pipe: Pipe, x: Any, y: Any, loss_fn: Callable[[Any, Any], Tensor] | None) -> None:
    pipe.zero_grad(set_to_none=True)
    pipe._train_step(x, y, loss_fn, None, None)
    synchronize(pipe.devices)


def profile_stages(
    pipe: Pipe, x: Any, y: Any, loss_fn: Callable[[Any, Any], Tensor] | None, steps: int = 2
) -> Costs:
    """Per-stage costs of ``pipe`` measured under ``'zb_h1'``, so the
    forward, input-gradient and weight-gradient passes are timed apart
    (``loss_fn`` None: the module's own loss, as ``train_step`` takes it).

    Returns:
        The fitted costs; ``costs.per_stage()`` are (forward, input_grad,
        weight_grad) triples. ``pipe.schedule``, its gradients and buffers
        (BatchNorm statistics) are put back.

    Raises:
        ValueError: ``steps`` below 1 (nothing would be timed).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"profile_stages: steps must be an int >= 1 (timed steps), got {steps!r}")
    with scheduled(pipe), untouched(pipe):
        pipe.schedule, pipe.virtual_stages = "zb_h1", None
        _step(pipe, x, y, loss_fn)  # warm-up
        with profile(pipe) as prof:
            for _ in range(steps):
                _step(pipe, x, y, loss_fn)
    # A batch the split does not divide ends in a short micro-batch: its
    # times count as a full one's share (fit scales them up).
    sizes = micro_sizes(x, pipe.chunks, pipe.split_size)
    return fit(prof, last_size=sizes[-1] / sizes[0])


def measure_memory(
    pipe: Pipe,
    x: Any,
    y: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    schedules: Sequence[Order] = SCHEDULES,
    virtual_stages: int | None = None,
) -> dict[str, dict[str, int]]:
    """The memory of one training step per schedule, after a warm-up step.

    Per CUDA device: ``torch.cuda.max_memory_allocated``. Per stage on any
    other device (the CPU): the peak bytes its forwards saved for backward
    (:class:`~mpstream.memory.StageSavedBytes`). A pipe with stages of both
    kinds reports both, each from a step of its own.

    Args:
        pipe: the pipe to step (its schedule is set to each in turn).
        x: a batch of inputs.
        y: its targets.
        loss_fn: ``loss_fn(output, target)``.
        schedules: the schedules to measure: names, or an order of actions
            (keyed ``'your order'``, :func:`label`).
        virtual_stages: stages per rank for the round-robin schedules
            (``'interleaved_1f1b'``, ...); default the pipe's own.

    Returns:
        Per schedule (:func:`label`), bytes keyed by how they were measured: a CUDA
        device's name (``"cuda:0"``) for its allocator's peak, ``"stage2"``
        for stage 2's saved-for-backward peak (a stage not on a CUDA
        device); the pipe's schedule, gradients and buffers are put back.
    """
    if virtual_stages is None:
        virtual_stages = pipe.virtual_stages
    out: dict[str, dict[str, int]] = {}
    with scheduled(pipe), untouched(pipe):
        for name in schedules:
            pipe.schedule = name
            kind = placement_of(name)
            pipe.virtual_stages = {"round_robin": virtual_stages, "v": 2}.get(kind)
            _step(pipe, x, y, loss_fn)
            out[label(name)] = _peaks(
                pipe.devices, list(pipe.partitions), lambda: _step(pipe, x, y, loss_fn)
            )
    return out


def _peaks(
    devices: Sequence[torch.device], stages: Sequence[nn.Module], step: Callable[[], None]
) -> dict[str, int]:
    """One step's memory, each stage measured as its device allows: a CUDA
    device's allocator peak under its name (``'cuda:0'``), the peak bytes a
    stage elsewhere saved for backward under the stage's (``'stage1'``).

    A pipe with both takes a step for each, so that the saved-tensor hooks
    stay out of the steps the allocator's peak is taken over."""
    gpus = sorted({d for d in devices if d.type == "cuda"}, key=str)
    others = [s for s, d in enumerate(devices) if d.type != "cuda"]
    out: dict[str, int] = {}
    if gpus:
        for d in gpus:
            torch.cuda.reset_peak_memory_stats(d)
        step()
        out.update({str(d): torch.cuda.max_memory_allocated(d) for d in gpus})
    if others:
        with StageSavedBytes([stages[s] for s in others]) as tracker:
            step()
        out.update({f"stage{s}": b for s, b in zip(others, tracker.peak_bytes)})
    return out


def split_cost(stage: nn.Module, sample: Tensor, repeat: int = 5) -> dict[str, float]:
    """Times a stage's split backward (B, then W) against its plain backward.

    Each round runs both on fresh forwards, back to back, after a warm-up
    round; the ratio is the median of the rounds' ratios, so a burst of load
    on a shared machine hits both sides of a round alike. The stage's input
    is cut as in a pipeline, so B has input gradients to compute.

    Returns:
        Medians in milliseconds (``backward_ms``, ``input_ms``,
        ``weight_ms``) and ``ratio``: (B + W) / backward. The stage's
        gradients and buffers (BatchNorm statistics) are put back.

    Raises:
        ValueError: ``repeat`` below 1.
    """
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"split_cost: repeat must be an int >= 1 (timed rounds), got {repeat!r}")
    device = sample.device

    def clock() -> float:
        synchronize([device])
        return time.perf_counter()

    def once(split: bool) -> tuple[float, float]:
        sink = GradSink()
        (x,) = cut(sink, (sample,))
        out = stage(x)
        grad = torch.ones_like(out)
        t0 = clock()
        if split:
            weight = backward_inputs([out], [grad])
            t1 = clock()
            weight.run()
        else:
            torch.autograd.backward([out], [grad])
            t1 = clock()
        t2 = clock()
        stage.zero_grad(set_to_none=True)
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3

    plain: list[float] = []
    inputs: list[float] = []
    weights: list[float] = []
    ratios: list[float] = []
    with untouched(stage):
        for i in range(repeat + 1):
            if i % 2:  # each goes first every other round
                a, b = once(False), once(True)
            else:
                b = once(True)
                a = once(False)
            if i:  # the first round warms up
                plain.append(a[0])
                inputs.append(b[0])
                weights.append(b[1])
                ratios.append((b[0] + b[1]) / a[0] if a[0] > 0 else float("nan"))
    return {
        "backward_ms": statistics.median(plain),
        "input_ms": statistics.median(inputs),
        "weight_ms": statistics.median(weights),
        "ratio": statistics.median(ratios),
    }

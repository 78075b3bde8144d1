"""What :class:`~mpstream.capture.step.CapturedStep` refuses before it
captures anything: a module that is no :class:`~mpstream.Pipe`, a bad
``warmup``, ``reduction``, ``loss_fn`` or ``optimizer``, ``pool=`` over stages
that replay graphs of their own, and a pipe being traced (a replay records
nothing). Each is checked here rather than left to the first warm-up step,
whose error would blame capture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..pipe.pipe import Pipe
from ..pipe.reduction import step_reduction
from ..stages.sequential import check_positive
from .devices import capture_devices

__all__ = ["Checked", "checked"]


class Checked(NamedTuple):
    """A step's arguments as :func:`checked` reads them."""

    #: The step's reduction: the one given, or the loss module's own.
    reduction: str
    #: Whether the stages replay graphs of their own (``Pipe(graphs=True)``).
    graphed: bool
    #: The GPUs the step is captured on (empty: the CPU).
    devices: list[torch.device]


def checked(
    pipe: object,
    loss_fn: Callable[[Any, Any], Tensor],
    optimizer: torch.optim.Optimizer | None,
    reduction: str | None,
    warmup: int,
    pool: Any,
) -> Checked:
    """Checks a :class:`~mpstream.capture.step.CapturedStep`'s arguments.

    Args:
        pipe: the pipe to capture a step of.
        loss_fn: ``loss_fn(output, target) -> scalar``.
        optimizer: the optimizer to step inside the graph, or None.
        reduction: ``'mean'``, ``'sum'`` or None (the loss module's own).
        warmup: warm-up steps before capture.
        pool: a memory pool to share, or None.

    Returns:
        The reduction, whether the stages are graphed, and the GPUs.

    Raises:
        TypeError: ``pipe`` is not a Pipe, ``loss_fn`` is not callable, or
            ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: ``warmup`` is not positive, ``reduction`` is unknown or
            contradicts the loss module, ``pool`` is given over graphed
            stages, or the pipe is being traced.
    """
    if not isinstance(pipe, Pipe):
        raise TypeError(f"CapturedStep needs an mpstream.Pipe, got {type(pipe).__name__}")
    check_positive("warmup", warmup)
    # Checked here, not by the first warm-up step, which would blame capture.
    reduction = step_reduction(reduction, loss_fn)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"CapturedStep: optimizer must be a torch.optim.Optimizer built on the pipe's "
            f"parameters (or None), got {type(optimizer).__name__}"
        )
    graphed = pipe.graphed
    if graphed and pool is not None:
        raise ValueError(
            "CapturedStep: pool= shares the memory of a step captured as one graph, but "
            "this pipe's stages replay graphs of their own (graphs=True), each stage with "
            "pools of its own; drop pool"
        )
    cuda = capture_devices(pipe.devices, graphed)
    sched = pipe.scheduler
    if cuda and not graphed and (sched.timing or sched.recording):
        raise ValueError(
            "CapturedStep: the pipe is being traced (its scheduler's timing or plan "
            "recording is on); a replay would record nothing. Capture outside "
            "mpstream.profile / trace."
        )
    return Checked(reduction, graphed, cuda)

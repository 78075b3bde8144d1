"""Whether DDP's reducer still waits for the backward of a ``ddp(x)`` forward.

DDP's forward with gradients enabled (outside ``no_sync()``) arms its
reducer: every gradient accumulated from then on is taken for that
forward's, until a backward has handed it each parameter's once. A
forward whose backward never runs (a validation pass under ``eval()``
without ``torch.no_grad()``, a metric computed through ``ddp``) leaves it
armed, which DDP's own next forward shrugs off. :func:`train_step
<mpstream.distributed.train_step>` runs no DDP forward: its per-micro-batch
gradients would reach the armed reducer, which fails the step from inside
its backward with torch's "Expected to mark a variable ready only once"
and then every later step of either kind, or, where the schedule
accumulates them out of the reducer's sight, leaves it armed for a later
one. :func:`track` notes each arming forward and the end of the backward
that reached its output; :func:`check_idle` refuses a step in between.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves

__all__ = ["track", "check_idle"]

# On a DDP module: whether a forward armed its reducer and no backward ended since.
_PENDING = "_mpstream_pending_forward"
# On a DDP module: the forward hook noting it (registered once).
_HOOK = "_mpstream_forward_hook"


def track(ddp: DistributedDataParallel) -> None:
    """Notes, from now on, each forward of ``ddp`` that arms its reducer,
    until a backward through its output ends. Registered once per module."""
    if getattr(ddp, _HOOK, None) is None:
        setattr(ddp, _PENDING, False)
        setattr(ddp, _HOOK, ddp.register_forward_hook(_forward_ran))


def _forward_ran(ddp: Any, args: Any, output: Any) -> None:
    # DDP's own condition for arming its reducer (its _post_forward).
    if not (torch.is_grad_enabled() and ddp.require_backward_grad_sync):
        return
    setattr(ddp, _PENDING, True)
    ref = weakref.ref(ddp)
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            t.grad_fn.register_hook(lambda *_: _reached(ref))


def _reached(ref: weakref.ref[Any]) -> None:
    """A backward reached an arming forward's output: DDP's reducer, which
    takes whichever gradients come, finalises by the end of that backward
    (a callback it queues, as this one)."""

    def ended() -> None:
        ddp = ref()
        if ddp is not None:
            setattr(ddp, _PENDING, False)

    torch.autograd.Variable._execution_engine.queue_callback(ended)


def check_idle(ddp: DistributedDataParallel) -> None:
    """Raises while a ``ddp(x)`` forward with gradients awaits its backward.

    Raises:
        RuntimeError: the reducer is armed by a forward :func:`track` saw.
    """
    if getattr(ddp, _PENDING, False):
        raise RuntimeError(
            "train_step: a ddp(x) forward ran with gradients enabled and its backward has not, "
            "so DistributedDataParallel's reducer still waits for that forward's gradients and "
            "would take train_step's for them (torch then fails this step and every later one "
            "with 'Expected to mark a variable ready only once'). Run forwards you do not "
            "train on (validation, metrics) under torch.no_grad(), or run that output's "
            "backward first; a step trained as loss_fn(ddp(x), y).backward() also starts "
            "the reducer afresh"
        )

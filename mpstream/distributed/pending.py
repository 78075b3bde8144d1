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
that reached its output and adds into its parameters' gradients (the
reducer's hooks sit on their accumulators: ``torch.autograd.grad`` through
the output, say for an input's gradient, leaves it armed);
:func:`check_idle` refuses a step in between.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves

from ..runtime import private

__all__ = ["track", "check_idle"]

# The DDP modules a forward armed whose backward has not ended since, weakly.
# Kept here rather than on the module: a copy (copy.deepcopy, pickle) gets a
# reducer of its own, idle, and must not inherit the original's note.
_ARMED: weakref.WeakSet[Any] = weakref.WeakSet()
# On a DDP module: the forward hook noting it (registered once; a copy
# carries it, as it carries the module's other hooks).
_HOOK = "_mpstream_forward_hook"


def track(ddp: DistributedDataParallel) -> None:
    """Notes, from now on, each forward of ``ddp`` that arms its reducer,
    until a backward through its output ends. Registered once per module."""
    if getattr(ddp, _HOOK, None) is None:
        setattr(ddp, _HOOK, ddp.register_forward_hook(_forward_ran))


def _forward_ran(ddp: Any, args: Any, output: Any) -> None:
    # DDP's own condition for arming its reducer (its _post_forward).
    if not (torch.is_grad_enabled() and ddp.require_backward_grad_sync):
        return
    _ARMED.add(ddp)
    ref = weakref.ref(ddp)
    # Static graph's first forward: the backward through its outputs ends
    # with DDP's delayed reduction of every parameter, autograd.grad's too.
    sink = bool(getattr(ddp, "static_graph", False)) and not getattr(
        ddp, "_static_graph_delay_allreduce_enqueued", True
    )
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            t.grad_fn.register_hook(lambda *_: _reached(ref, sink))


def _reached(ref: weakref.ref[Any], sink: bool) -> None:
    """A backward reached an arming forward's output: DDP's reducer, which
    takes whichever gradients come, finalises by the end of that backward
    (a callback it queues, as this one) if the backward adds into its
    parameters' gradients: its hooks run after their accumulators."""
    ddp = ref()
    if ddp is None or not (sink or _accumulates(ddp)):
        return

    def ended() -> None:
        ddp = ref()
        if ddp is not None:
            _ARMED.discard(ddp)

    torch.autograd.Variable._execution_engine.queue_callback(ended)


def _accumulates(ddp: Any) -> bool:
    """Whether the running backward pass adds into the gradient of one of
    ``ddp``'s parameters (not ``torch.autograd.grad``, nor ``backward(inputs=)``
    without them), running the accumulator DDP's reducer hooks."""
    for p in ddp.parameters():
        if not p.requires_grad:
            continue
        try:
            if private.will_engine_execute_node(get_gradient_edge(p).node):
                return True
        except RuntimeError:  # torch.autograd.grad() asked for this parameter's gradient
            return False
    return False


def check_idle(ddp: DistributedDataParallel) -> None:
    """Raises while a ``ddp(x)`` forward with gradients awaits its backward.

    Raises:
        RuntimeError: the reducer is armed by a forward :func:`track` saw.
    """
    if ddp in _ARMED:
        raise RuntimeError(
            "train_step: a ddp(x) forward ran with gradients enabled and its backward has not, "
            "so DistributedDataParallel's reducer still waits for that forward's gradients and "
            "would take train_step's for them (torch then fails this step and every later one "
            "with 'Expected to mark a variable ready only once'). Run forwards you do not "
            "train on (validation, metrics) under torch.no_grad(), take gradients you do not "
            "train on (torch.autograd.grad, an input's gradient) through ddp.module(x), "
            "which leaves the reducer alone, or run that output's backward first; a step "
            "trained as loss_fn(ddp(x), y).backward() also starts the reducer afresh"
        )

"""One :class:`~mpstream.Pipe` per process under DDP: wrapping, the training step, checkpoints.

Every process (launched by ``torchrun``) builds the same pipeline over its own
devices and wraps it in ``torch.nn.parallel.DistributedDataParallel``; PyTorch's
process group averages the gradients over the processes. Two ways to train:

* ``loss_fn(ddp(x), y).backward()``: DDP's own reducer syncs the gradients
  while the pipeline's backward runs. Works for every schedule and checkpoint
  mode; the forward is fill-drain whatever :attr:`Pipe.schedule` says.
* :func:`train_step`: :meth:`Pipe.train_step` (any schedule and checkpoint
  mode), each stage's gradients all-reduced as soon as its last backward
  task has run (:mod:`.gradients`), while the earlier stages still compute.
  DDP's reducer cannot do it: its hooks expect every gradient to be
  accumulated once per step, and ``train_step`` accumulates one micro-batch at
  a time outside ``DDP.forward``; ``ddp.module.train_step`` alone would leave
  each process with its own, unsynchronised gradients, so a pipe the DDP
  module checked refuses it while that module lives.

:func:`wrap` builds the DDP module and rejects, before any step runs, the
options that cannot work with a pipeline (and stage devices the process
group cannot reduce on, :mod:`.placement`); :func:`sync_buffers` broadcasts
rank 0's buffers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from .._words import count_of
from ..pipe.batchargs import batch_argument
from ..pipe.module import unsplit
from ..pipe.pipe import Pipe
from ..pipe.step import averaged_by
from ..runtime.errors import annotate
from .gradients import BUCKET_BYTES, StageReducer
from .pending import check_idle, track
from .placement import check_placement

__all__ = [
    "wrap",
    "train_step",
    "sync_buffers",
]

# DDP arguments that would move inputs or outputs between devices: the pipe
# places its stages itself and returns the output on the last stage's device.
_PLACEMENT_ARGS = ("device_ids", "output_device")

# DDP options that cannot work with a pipeline, and why.
_UNSUPPORTED = {
    "mixed_precision": (
        "DDP's (private) mixed precision casts the parameters on one side stream of the "
        "current device from forward hooks, which train_step's per-stage calls bypass; use "
        "torch.autocast or a lower-precision model instead"
    ),
    "delay_all_reduce_named_params": (
        "the delayed all-reduce keeps those gradients in one buffer on device_ids[0] or the "
        "CPU, and is launched from a gradient hook that train_step triggers once per "
        "micro-batch"
    ),
}
_UNSUPPORTED["param_to_hook_all_reduce"] = _UNSUPPORTED["delay_all_reduce_named_params"]

# Raised by pipe.train_step on a pipe a live DDP module wraps.
_UNAVERAGED = (
    "this pipe is wrapped in DistributedDataParallel: pipe.train_step would leave each "
    "process with its own gradients, never averaged, and the replicas would drift apart; "
    "call mpstream.distributed.train_step(ddp, inputs, target, loss_fn) (inside "
    "ddp.no_sync() to accumulate locally)"
)

# Set on a DDP module once its processes' pipelines were found alike.
_CHECKED = "_mpstream_pipelines_checked"


def wrap(pipe: Pipe, **ddp_kwargs: Any) -> DistributedDataParallel:
    """Wraps a pipeline in ``DistributedDataParallel`` after checking it can work.

    Every schedule and checkpoint mode works, with ``ddp(x)`` + ``backward()``
    and with :func:`train_step`; so do ``find_unused_parameters``,
    ``static_graph``, ``gradient_as_bucket_view`` and bucket sizes. DDP sees a
    multi-device module (or a CPU one), so ``device_ids`` stays ``None``.

    Args:
        pipe: the pipeline of this process, stages already on its devices.
        **ddp_kwargs: passed to ``DistributedDataParallel`` (``process_group``,
            ``find_unused_parameters``, ``broadcast_buffers``, ...).

    Returns:
        ``DistributedDataParallel(pipe, device_ids=None, ...)``.

    Raises:
        TypeError: ``pipe`` is not a :class:`~mpstream.Pipe`.
        RuntimeError: ``torch.distributed`` is not initialised, or the
            pipe is not split yet (a module split by ``torch.export``
            without ``sample=``: call it once first).
        ValueError: ``device_ids``/``output_device`` given; ``mixed_precision``
            or delayed all-reduce requested; stages on several device types;
            the process group's backend cannot reduce tensors on the stages'
            device type (NCCL with CPU stages); the processes' pipelines
            differ (raised on every process of the group).
    """
    if not isinstance(pipe, Pipe):
        raise TypeError(f"wrap takes an mpstream.Pipe, got {type(pipe).__name__}")
    if pipe.__dict__["_graph"] is None:
        # DDP buckets the parameters where they sit now; the split moves them.
        raise unsplit("mpstream.distributed.wrap")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group() "
            "first (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for it)"
        )
    for name in _PLACEMENT_ARGS:
        if ddp_kwargs.get(name) is not None:
            raise ValueError(
                f"{name}={ddp_kwargs[name]!r}: a Pipe places its stages itself and returns its "
                f"output on the last stage's device, so DistributedDataParallel must not move "
                f"inputs or outputs; leave {name}=None"
            )
    for name, why in _UNSUPPORTED.items():
        if ddp_kwargs.get(name) is not None:
            raise ValueError(f"{name} is not supported with an mpstream.Pipe: {why}")
    group = ddp_kwargs.get("process_group")
    if group is None and ddp_kwargs.get("device_mesh") is not None:
        group = ddp_kwargs["device_mesh"].get_group(mesh_dim=0)
    check_placement(pipe.devices, dist.get_backend_config(group))
    ddp_kwargs.pop("device_ids", None)
    ddp_kwargs.pop("output_device", None)
    ddp = DistributedDataParallel(pipe, device_ids=None, output_device=None, **ddp_kwargs)
    _check_same_pipelines(ddp)
    return ddp


def _check_same_pipelines(ddp: DistributedDataParallel) -> None:
    """Raises on every process unless all of the group's pipelines reduce alike.

    DDP's constructor compares the parameters' shapes, not how each process
    split them into stages. ``train_step``'s all-reduces pair up by position
    (each stage's flat gradients, last stage first), so pipelines split
    otherwise would average one process's stage with another's: the group
    breaks where the sizes differ, and the gradients are silently wrong
    where they agree. One all-reduce of a digest of each process's layout.
    """
    units = StageReducer(ddp).units()
    layout = [
        [(units.names.get(id(p)), tuple(p.shape), str(p.dtype), p.device.type) for p in ps]
        for ps in (units.params[unit] for unit in units.order)
    ]
    cap = int(getattr(ddp, "bucket_bytes_cap", BUCKET_BYTES))
    # 56 bits: the digest and its negation both fit an int64.
    mine = int.from_bytes(hashlib.sha256(repr((cap, layout)).encode()).digest()[:7], "big")
    first = next((ps[0] for ps in units.params.values() if ps), None)
    device = first.device if first is not None else torch.device("cpu")
    extremes = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=ddp.process_group)
    highest, lowest = extremes.tolist()
    if highest != mine or -lowest != mine:  # every process sees max != min alike
        counts = [len(units.params[unit]) for unit in sorted(units.order) if unit >= 0]
        raise ValueError(
            f"the pipelines differ between the processes of the group (their stages, balance, "
            f"parameters that require grad, dtypes or DDP bucket size): train_step would "
            f"average each stage's gradients with another process's other parameters. Build "
            f"the same Pipe on every process; this one's stages hold {counts} parameters"
        )
    setattr(ddp, _CHECKED, True)
    averaged_by(ddp.module, ddp, _UNAVERAGED)
    track(ddp)


def _check_ddp_pipe(ddp: object, what: str) -> Pipe:
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"{what} takes a DistributedDataParallel module, got {type(ddp).__name__}")
    if not isinstance(ddp.module, Pipe):
        raise TypeError(
            f"{what} needs DistributedDataParallel around an mpstream.Pipe, got one around "
            f"{type(ddp.module).__name__}"
        )
    for name in ("mixed_precision", "_delay_all_reduce_params"):
        # Built without wrap(): these act in DDP's forward and per-gradient hooks.
        if getattr(ddp, name, None):
            raise ValueError(f"{what} does not support DistributedDataParallel's {name.strip('_')}")
    if getattr(ddp, "_comm_hooks", None):
        raise ValueError(
            f"{what} averages the gradients with its own all-reduce; the communication hook "
            f"registered on this DistributedDataParallel would be ignored"
        )
    return ddp.module


@batch_argument(
    "mpstream.distributed.train_step",
    "train_step(ddp, inputs, target, loss_fn), with inputs a dict or a tuple",
)
def train_step(
    ddp: DistributedDataParallel,
    inputs: Any,
    target: Any = None,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    *,
    reduction: str | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> Tensor:
    """:meth:`Pipe.train_step` of this process, its gradients averaged over processes.

    The pipeline runs forward and backward of every micro-batch in its
    :attr:`~mpstream.Pipe.schedule` order with its checkpoint mode. Each
    stage's accumulated gradients are all-reduced as soon as its last
    backward (or weight) task has run, while the stages before it still
    compute theirs (as DDP overlaps its buckets with the backward), and
    divided by the group size once the step is done. With equal per-process
    batches and ``reduction='mean'`` the result equals one process's
    ``train_step`` on the concatenated batch. Stages are reduced last to
    first on every process, whatever order its schedule ended them in. A
    step fails on every process or on none: one whose step fails completes
    the sequence of all-reduces with zeros and raises; the others raise
    ``RuntimeError``; each puts its gradients back as they were.

    As DDP's forward does, buffers (BatchNorm statistics) are first broadcast
    from the group's first process when ``ddp.broadcast_buffers`` is true and
    the previous call (or DDP forward) synchronised. Inside ``ddp.no_sync()``
    the gradients only accumulate locally; the next call outside it averages
    the accumulated sum, as with DDP.

    Call it on every process of the group, with the same pipeline; not after
    a ``ddp(x)`` with gradients whose backward has not run (DDP's reducer
    would take this step's gradients for that forward's: refused).

    Args:
        ddp: the pipeline wrapped by :func:`wrap` (or by
            ``DistributedDataParallel`` directly).
        inputs: this process's share of the batch, as
            :meth:`~mpstream.Pipe.train_step` takes it: one input, a tuple
            of positional inputs, or a traced module's keyword inputs as
            one dict (not spread into keywords).
        target: its targets; None with no ``loss_fn``.
        loss_fn: ``loss_fn(output, target) -> scalar`` per micro-batch;
            None: the module's own loss, as in :meth:`~mpstream.Pipe.train_step`.
        reduction: as in :meth:`~mpstream.Pipe.train_step` (default: the loss module's own, or
            ``'mean'``).
        scaler: a ``torch.amp.GradScaler`` scaling each micro-batch's loss
            (see :meth:`~mpstream.Pipe.train_step`); the scaled gradients are
            averaged, and ``scaler.step(optimizer)`` unscales them as usual.

    Returns:
        This process's loss on its share (detached, not averaged over
        processes), on the last stage's device.

    Raises:
        TypeError: the batch spread into keywords (``train_step(ddp, **batch)``:
            pass it as ``inputs``), ``ddp`` is not a DDP module around a Pipe, or the
            pipeline's :meth:`~mpstream.Pipe.train_step` rejects the batch.
        ValueError: DDP mixed precision, delayed all-reduce or a
            communication hook is set (train_step reduces the gradients
            itself), a gradient is sparse, the processes' pipelines differ
            (checked at the first call of a DDP module not made by
            :func:`wrap`), or bad inputs as for :meth:`~mpstream.Pipe.train_step`.
        RuntimeError: another process of the group failed this step (this
            one's is undone too); inside ``Join([ddp])``, a process of
            the group has run out of batches (Join cannot shadow this step's
            all-reduces); or a ``ddp(x)`` forward with gradients has not had
            its backward (DDP's reducer would take this step's gradients
            for it: run such forwards under ``torch.no_grad()``).
    """
    pipe = _check_ddp_pipe(ddp, "train_step")
    _check_none_joined(ddp)
    if not getattr(ddp, _CHECKED, False) and pipe.__dict__["_graph"] is not None:
        # Built without wrap(): checked at the first call, which every
        # process makes together (a traced pipe is split by its first call).
        _check_same_pipelines(ddp)
    # As DDP's forward: buffers are broadcast only after a call that synced
    # (not again inside no_sync()), and this call records whether it syncs.
    # Recorded before the step runs, so that a no_sync() step failing on one
    # process only leaves every process's flag alike.
    if ddp.broadcast_buffers and ddp.require_forward_param_sync:
        sync_buffers(ddp)
    ddp.require_forward_param_sync = ddp.require_backward_grad_sync
    # DDP's reducer arms its gradient hooks only in DDP.forward, which is not
    # called here, so the pipeline's per-micro-batch backward runs unhooked.
    if not ddp.require_backward_grad_sync:  # inside no_sync(): accumulate only
        check_idle(ddp)  # DDP's armed reducer would take these gradients all the same
        return pipe._train_step(inputs, target, loss_fn, reduction, scaler)
    reducer = StageReducer(ddp)
    try:
        # Inside: a process that alone ran such a forward (validation on
        # rank 0 only) still completes the step's all-reduces.
        check_idle(ddp)
        return pipe._train_step(inputs, target, loss_fn, reduction, scaler, stage_done=reducer)
    except BaseException as exc:
        # Also a failure before the step began (a bad batch on this process
        # only): the other processes' collectives are matched, and they learn
        # of it and undo their step too. A second abort() does nothing.
        try:
            reducer.abort()
        except BaseException as cleanup:
            annotate(exc, f"mpstream: completing the gradients' reduction raised: {cleanup!r}")
        raise


def _check_none_joined(ddp: DistributedDataParallel) -> None:
    """Inside ``Join([ddp])``: tells the processes that ran out of batches
    that this one still trains, as DDP's forward does, and raises if some
    have. Join shadows only DDP's own collectives; a joined process would
    answer this step's all-reduces with those, breaking the group.
    ``throw_on_early_termination=True`` makes torch raise on every process
    instead (the group stays usable)."""
    work = Join.notify_join_context(ddp)  # None outside Join
    if work is None:
        return
    training = int(work.get_future().wait()[0].item())  # the all-reduced ones
    size = dist.get_world_size(ddp.join_process_group)
    if training < size:
        raise RuntimeError(
            f"{size - training} of the group's {count_of(size, 'process', 'processes')} ran out of "
            f"batches inside Join([ddp]), which shadows DDP's own collectives but not train_step's "
            f"all-reduces: give every process the same number of batches "
            f"(DistributedSampler(..., drop_last=True) and a loader with drop_last=True), use "
            f"Join(..., throw_on_early_termination=True) to stop every process at once, or train "
            f"with ddp(x) under Join. The processes that joined wait until this one exits"
        )


def sync_buffers(ddp: DistributedDataParallel) -> None:
    """Copies the wrapped module's buffers from the group's first process to all.

    What DDP's forward does with ``broadcast_buffers=True``: BatchNorm running
    statistics (and any other buffer DDP does not ignore) become rank 0's.

    Args:
        ddp: a DistributedDataParallel module; every process of its group
            must call this.
    """
    group = ddp.process_group
    ignored = ddp.parameters_to_ignore
    buffers = [b for name, b in ddp.module.named_buffers() if name not in ignored]
    if not buffers:
        return
    src = dist.get_global_rank(group, 0)
    is_src = dist.get_rank(group) == 0
    cap = int(getattr(ddp, "bucket_bytes_cap", BUCKET_BYTES))
    with torch.no_grad():
        for bucket in _buckets(buffers, cap):
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.broadcast(flat, src=src, group=group)
            if not is_src:
                # Through .data: graphs still alive may have saved these
                # buffers, and an in-place write would bump their versions.
                _unflatten_into(flat, [b.data for b in bucket])


def _buckets(tensors: Sequence[Tensor], cap: int) -> Iterator[list[Tensor]]:
    """Groups tensors by device and dtype, in order, at most ``cap`` bytes each."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for group in groups.values():
        bucket: list[Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > cap:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket


def _unflatten_into(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n

"""``mpstream.Pipe``: an ``nn.Sequential`` pipelined over devices and streams."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .balance import balance_by_size, balance_by_time
from .batchnorm import DeferredBatchNorm, deferred_norms, deferred_update
from .checkpoint import check_mode, checkpoint_stop
from .compiling import CompileOption, compile_options, compile_stages
from .errors import stage_labels
from .microbatch import Value, as_value, batch_device, gather, scatter, split
from .partition import DeviceLike, check_positive, split_module
from .schedule import SCHEDULES, Schedule
from .scheduler import EventScheduler
from .stream import current_stream, record_stream
from .transfer import host_staging
from .worker import Staging, Worker

REDUCTIONS = ("mean", "sum")

__all__ = ["Pipe"]


class Pipe(nn.Module):
    """Pipeline-parallel wrapper running each stage on its own CUDA stream.

    The batch is split into micro-batches along dim 0. Stage ``s`` computes
    every micro-batch on a dedicated compute stream; its output moves to the
    next stage's device on dedicated copy streams; CUDA events from mpstream's
    C++ scheduler order all of it, so the copy of one micro-batch overlaps the
    compute of the next. Backward runs through autograd on the same streams.
    On CPU the streams are placeholders and the results are the same.

    Args:
        module: an ``nn.Sequential``. Without ``balance``/``devices`` each
            child is one stage and must already sit on its device.
        chunks: number of micro-batches (like ``torch.chunk``).
        split_size: micro-batch size (like ``torch.split``); give at most one
            of ``chunks`` and ``split_size``; neither means one micro-batch.
        balance: layers per stage; the module's children are partitioned
            and each partition moved to its entry of ``devices``. ``'time'``
            or ``'size'`` profiles the layers on ``sample`` and picks the
            split that minimises the slowest (or largest) stage.
        devices: one device per stage (several stages may share a device).
        checkpoint: ``'never'`` (default), ``'except_last'`` or ``'always'``:
            which micro-batches keep only their stage inputs and recompute the
            rest during backward (on the stage's stream; never in eval mode).
        deferred_batch_norm: replace BatchNorm layers by
            :class:`~mpstream.batchnorm.DeferredBatchNorm`, whose running
            statistics are updated once per mini-batch as the single-device
            model would.
        schedule: order of :meth:`train_step`: ``'gpipe'`` (fill-drain) or
            ``'1f1b'`` (at most ``stages - s`` micro-batches in flight on
            stage ``s``). ``pipe(x)`` always runs fill-drain.
        sample: a representative micro-batch, for ``balance='time'|'size'``.
        force_copies: for experiments: copy every micro-batch between
            consecutive stages (and its gradient back) on the copy streams
            even when they share a device, as between two GPUs. With all
            stages on one GPU this runs the data flow of a multi-GPU layout,
            device-to-device copies included; results are unchanged, the
            copies cost time and memory.
        compile: ``True`` or a dict of ``torch.compile`` keyword arguments
            (e.g. ``{"backend": "aot_eager"}``): each stage's partition is
            compiled. The layers stay registered uncompiled, so
            ``state_dict`` keys do not change.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``; ``chunks`` or
            ``split_size`` is not an int.
        ValueError: ``chunks``/``split_size`` < 1 or both given; a layer is
            repeated; layers on different devices share a parameter; a stage
            spans devices or sits on a device that does not exist;
            balance/devices do not fit; an unknown checkpoint mode or
            schedule.

    Example::

        model = nn.Sequential(part0.to("cuda:0"), part1.to("cuda:1"))
        pipe = mpstream.Pipe(model, split_size=12)
        loss_fn(pipe(x), y.to("cuda:1")).backward()
    """

    def __init__(
        self,
        module: nn.Module,
        chunks: int | None = None,
        *,
        split_size: int | None = None,
        balance: Sequence[int] | str | None = None,
        devices: Sequence[DeviceLike] | None = None,
        checkpoint: str = "never",
        deferred_batch_norm: bool = False,
        schedule: str = "gpipe",
        sample: Value | None = None,
        force_copies: bool = False,
        compile: CompileOption = False,
    ) -> None:
        super().__init__()
        if chunks is not None and split_size is not None:
            raise ValueError("give either chunks or split_size, not both")
        self._chunks = None if chunks is None else check_positive("chunks", chunks)
        self._split_size = None if split_size is None else check_positive("split_size", split_size)
        self.checkpoint = check_mode(checkpoint)
        compile_kwargs = compile_options(compile)  # before any layer moves
        if schedule not in SCHEDULES:
            valid = ", ".join(repr(x) for x in SCHEDULES)
            raise ValueError(f"schedule must be one of {valid}; got {schedule!r}")
        self.schedule = schedule
        if deferred_batch_norm:
            module = DeferredBatchNorm.convert(module)
        if isinstance(balance, str):
            balance = _auto_balance(module, balance, devices, sample)
        stages = split_module(module, balance, devices)
        for name, layer in stages.layers:
            self.add_module(name, layer)
        # Not registered: the layers above own the parameters, so state_dict
        # keys stay those of the wrapped Sequential whatever the split.
        self.__dict__["_partitions"] = nn.ModuleList(stages.partitions)
        self.__dict__["_devices"] = list(stages.devices)
        self.__dict__["_balance"] = list(stages.balance)
        self.__dict__["_runtime"] = None
        self.__dict__["_compile"] = compile_kwargs
        self.force_copies = bool(force_copies)

    # -- configuration -------------------------------------------------
    @property
    def partitions(self) -> nn.ModuleList:
        """One ``nn.Sequential`` per stage."""
        return self.__dict__["_partitions"]  # type: ignore[no-any-return]

    @property
    def devices(self) -> list[torch.device]:
        """The device of each stage."""
        return list(self.__dict__["_devices"])

    @property
    def balance(self) -> list[int]:
        """Layers per stage."""
        return list(self.__dict__["_balance"])

    @property
    def chunks(self) -> int | None:
        """Number of micro-batches, or None when ``split_size`` is set."""
        return self._chunks

    @chunks.setter
    def chunks(self, value: int | None) -> None:
        self._chunks = None if value is None else check_positive("chunks", value)
        if value is not None:
            self._split_size = None

    @property
    def split_size(self) -> int | None:
        """Micro-batch size, or None when ``chunks`` is set."""
        return self._split_size

    @split_size.setter
    def split_size(self, value: int | None) -> None:
        self._split_size = None if value is None else check_positive("split_size", value)
        if value is not None:
            self._chunks = None

    @property
    def scheduler(self) -> EventScheduler:
        """The event scheduler and stage streams (created on first use)."""
        return self._rt()[0]

    def _rt(self) -> tuple[EventScheduler, Worker, dict[tuple[Any, ...], Schedule]]:
        rt = self.__dict__["_runtime"]
        if rt is None:
            sched = EventScheduler(self.devices)
            stages = compile_stages(list(self.partitions), self.__dict__["_compile"])
            labels = stage_labels(list(self._modules), self.balance, self.devices)
            rt = (sched, Worker(stages, sched, self.force_copies, labels), {})
            self.__dict__["_runtime"] = rt
        return rt  # type: ignore[no-any-return]

    def schedule_for(
        self,
        micros: int,
        input_device: torch.device,
        *,
        training_step: bool = False,
        target_device: torch.device | None = None,
    ) -> Schedule:
        """The (cached) schedule for ``micros`` micro-batches.

        Forward-only runs are fill-drain; a training step uses
        :attr:`schedule` with backward tasks, and a transfer task per
        micro-batch when the targets sit on ``target_device``, not on the
        last stage's device.
        """
        devs = self.__dict__["_devices"]
        name = self.schedule if training_step else "gpipe"
        copy_target = training_step and target_device not in (None, devs[-1])
        key = (name, micros, input_device, training_step, copy_target, self.force_copies)
        cache = self._rt()[2]
        sched = cache.get(key)
        if sched is None:
            copy_in = [input_device != devs[0]] + [
                self.force_copies or devs[s] != devs[s - 1] for s in range(1, len(devs))
            ]
            sched = Schedule(
                name, len(devs), micros, copy_in, backward=training_step, copy_target=copy_target
            )
            cache[key] = sched
        return sched

    def _prepare(self, micros: int) -> int:
        """Per-run setup; returns how many micro-batches to checkpoint."""
        for norm in deferred_norms(self):
            norm.expected = micros
        training = self.training and torch.is_grad_enabled()
        return checkpoint_stop(self.checkpoint, micros, training)

    # -- running -------------------------------------------------------
    def forward(self, x: Value | list[torch.Tensor]) -> Value:
        """Runs the pipeline on a batch.

        Args:
            x: a Tensor or a tuple/list of Tensors, split along dim 0. It may
                sit on the CPU or on any device. Host memory moves to the
                first stage's device in transfer tasks on its io stream, which
                never block the host: pageable tensors pass through pinned
                buffers (a host copy of the batch per step), pinned ones
                (``DataLoader(pin_memory=True)``) move directly, as
                ``x.to(device, non_blocking=True)`` would: do not overwrite a
                pinned batch before the output is used. When ``x`` requires
                grad, its gradient comes back asynchronously and the backward
                call returns once it is in place.

        Returns:
            The output on the last stage's device, concatenated along dim 0:
            a Tensor or a tuple of Tensors, as the last stage returns.

        Raises:
            TypeError: a non-tensor input, or a stage returned something other
                than a Tensor or a tuple of Tensors (the stage is named).
            ValueError: an empty batch, or tensors of different batch sizes.

        An exception raised in a stage reaches the caller unchanged, with a
        note naming the stage, micro-batch and task (a backward that autograd
        runs later raises from its engine, without a note); the statistics a
        :class:`~mpstream.batchnorm.DeferredBatchNorm` had accumulated for
        the failed batch are dropped (they update only once all stages finish).
        """
        value = as_value(x)
        micro = scatter(value, self._chunks, self._split_size)
        schedule = self.schedule_for(len(micro), batch_device(value))
        _, worker, _ = self._rt()
        staging = self._staging(value, self.devices[0])
        stop = self._prepare(len(micro))
        with deferred_update(self, len(micro)):
            outputs = worker.forward(micro, schedule, stop, staging)
        return gather(outputs)

    def _staging(self, value: Value, device: torch.device) -> list[Staging] | None:
        """Per micro-batch pinned buffers for ``value``'s pageable tensors."""
        buffers = host_staging(value, device)
        if buffers is None:
            return None
        # Split like the batch itself (same sizes along dim 0).
        parts = [None if b is None else split(b, self._chunks, self._split_size) for b in buffers]
        micros = max(len(p) for p in parts if p is not None)
        return [tuple(None if p is None else p[i] for p in parts) for i in range(micros)]

    def train_step(
        self,
        inputs: Value | list[Tensor],
        target: Value | list[Tensor],
        loss_fn: Callable[[Any, Any], Tensor],
        *,
        reduction: str = "mean",
        scaler: torch.amp.GradScaler | None = None,
    ) -> Tensor:
        """Forward and backward of every micro-batch in :attr:`schedule` order.

        Gradients accumulate into ``.grad`` as if ``loss_fn`` had been applied
        to the whole batch: each micro-batch's loss is weighted by its share
        of the batch (``reduction='mean'``, for losses that average over the
        batch) or by 1 (``reduction='sum'``). Call ``optimizer.step()`` after.
        Only parameters get gradients: inputs and targets are detached.

        Args:
            inputs: the batch, as for :meth:`forward`.
            target: targets with the same batch size, split the same way and
                moved to the last stage's device.
            loss_fn: ``loss_fn(output, target) -> scalar`` per micro-batch.
            reduction: how ``loss_fn`` reduces over the batch.
            scaler: a ``torch.amp.GradScaler``: each micro-batch's weighted
                loss is scaled by ``scaler.scale`` before its backward, so the
                gradients are scaled; call ``scaler.step(optimizer)`` and
                ``scaler.update()`` after, as usual.

        Returns:
            The whole-batch loss (detached, unscaled), on the last stage's
            device.

        Raises:
            TypeError: bad inputs or targets, a stage returned a non-tensor,
                ``loss_fn`` returned something other than a scalar tensor, or
                ``scaler`` is not a ``GradScaler``.
            ValueError: empty batch, targets of another batch size, or an
                unknown ``reduction``.

        Inputs and targets in host memory move in transfer tasks that never
        block the host (see :meth:`forward`). If anything raises, the
        gradients and BatchNorm statistics are restored to what they were
        before the call. For that, each stage's existing gradients (under
        gradient accumulation) are cloned on its stream when its first
        backward of the step begins; a step that starts with no gradients,
        or fails before the backward, clones nothing.
        """
        if reduction not in REDUCTIONS:
            valid = ", ".join(repr(r) for r in REDUCTIONS)
            raise ValueError(f"reduction must be one of {valid}; got {reduction!r}")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        # Parameter gradients only: inputs are detached, so whether x.grad
        # fills cannot depend on where the batch sits.
        value = _detached(as_value(inputs))
        labels = _detached(as_value(target, "target"))
        batch = _batch_size(value)
        if _batch_size(labels) != batch:
            raise ValueError(f"target has batch size {_batch_size(labels)} but inputs have {batch}")
        micro = scatter(value, self._chunks, self._split_size)
        micro_targets = scatter(labels, self._chunks, self._split_size)
        weights = [_batch_size(m) / batch if reduction == "mean" else 1.0 for m in micro]
        schedule = self.schedule_for(
            len(micro),
            batch_device(value),
            training_step=True,
            target_device=batch_device(labels),
        )
        _, worker, _ = self._rt()
        staging = self._staging(value, self.devices[0])
        target_staging = self._staging(labels, self.devices[-1])
        snapshot = _Snapshot(self)
        try:
            with torch.enable_grad():
                stop = self._prepare(len(micro))
                losses = worker.train(
                    micro,
                    micro_targets,
                    schedule,
                    loss_fn,
                    weights,
                    stop,
                    staging,
                    target_staging,
                    snapshot.save_grads,
                    None if scaler is None else scaler.scale,
                )
        except BaseException:
            snapshot.restore()
            raise
        return torch.stack(losses).sum()

    # -- Sequential-like access -----------------------------------------
    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(m for m in self._modules.values() if m is not None)

    def __getitem__(self, index: int | slice) -> nn.Module:
        layers = [m for m in self._modules.values() if m is not None]
        if isinstance(index, slice):
            return nn.Sequential(*layers[index])
        return layers[index]

    def train(self, mode: bool = True) -> Pipe:
        """Sets training mode on the layers and the partition wrappers."""
        super().train(mode)
        self.partitions.train(mode)
        return self

    # -- placement is fixed ----------------------------------------------
    def cuda(self, device: Any = None) -> Pipe:  # type: ignore[override]
        raise TypeError("Pipe's stages are placed at construction; .cuda() would move them all")

    def cpu(self) -> Pipe:  # type: ignore[override]
        raise TypeError("Pipe's stages are placed at construction; .cpu() would move them all")

    def to(self, *args: Any, **kwargs: Any) -> Pipe:  # type: ignore[override]
        """Converts dtype (``.to(torch.half)``); device moves raise ``TypeError``."""
        device, _, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            raise TypeError(
                "Pipe's stages are placed at construction; .to(device) would move them all "
                "(use .to(dtype) to convert)"
            )
        return super().to(*args, **kwargs)  # type: ignore[no-any-return]

    # -- pickling / deepcopy: streams and the C++ scheduler are rebuilt -----
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_runtime"] = None
        return state

    def extra_repr(self) -> str:
        split = (
            f"split_size={self._split_size}" if self._split_size else f"chunks={self._chunks or 1}"
        )
        devs = ", ".join(str(d) for d in self.__dict__["_devices"])
        return f"{split}, balance={self.__dict__['_balance']}, devices=[{devs}]"


def _detached(value: Value) -> Value:
    return value.detach() if isinstance(value, Tensor) else tuple(t.detach() for t in value)


def _batch_size(value: Value) -> int:
    first = value if isinstance(value, Tensor) else value[0]
    return int(first.size(0))


def _auto_balance(
    module: nn.Module, how: str, devices: Sequence[DeviceLike] | None, sample: Value | None
) -> list[int]:
    if how not in ("time", "size"):
        raise ValueError(f"balance must be a list of ints, 'time' or 'size'; got {how!r}")
    if devices is None:
        raise ValueError(f"balance={how!r} needs devices= (one per stage) to know how many stages")
    if sample is None:
        raise ValueError(f"balance={how!r} needs sample= (a representative micro-batch) to profile")
    stages = len(devices)
    device = torch.device(devices[0])
    if how == "time":
        return balance_by_time(module, sample, stages, device=device)
    return balance_by_size(module, sample, stages, device=device)


class _Snapshot:
    """Gradients and BatchNorm state of a pipe, restorable after a failure.

    BatchNorm buffers (small) are cloned up front. Gradients are saved per
    stage by :meth:`save_grads`, which the worker calls inside the stage's
    first backward task: nothing accumulates into them before that.
    """

    def __init__(self, pipe: Pipe) -> None:
        self.partitions = list(pipe.partitions)
        self.grads: dict[int, tuple[nn.Parameter, Tensor | None]] = {}
        self.norms = [
            (m, [b.detach().clone() for b in m.buffers(recurse=False)])
            for m in pipe.modules()
            if isinstance(m, _BatchNorm)
        ]

    def save_grads(self, stage: int) -> None:
        """Saves the gradients of ``stage``'s parameters (on the current stream)."""
        for p in self.partitions[stage].parameters():
            if id(p) not in self.grads:
                self.grads[id(p)] = (p, None if p.grad is None else p.grad.detach().clone())

    def restore(self) -> None:
        for p, g in self.grads.values():
            if g is not None:
                # Cloned on a stage stream; the caller's stream uses it now.
                record_stream(g, current_stream(g.device))
            p.grad = g
        for m, buffers in self.norms:
            # Through .data: graphs still alive may have saved these buffers.
            for b, saved in zip(m.buffers(recurse=False), buffers):
                b.data.copy_(saved)
            if isinstance(m, DeferredBatchNorm):
                m.reset_accumulation()

"""A pipe's whole training step captured in a CUDA graph and replayed.

Eager micro-batching launches every kernel once per micro-batch from one
Python thread; on a fast GPU that thread sets the pace. On one H100 at the
tutorial's sizes (split 12) the host took 225.7 ms to issue a 225.8 ms step,
and a captured step with SGD replayed in 0.18x the eager time with the same
parameters (docs/results/h100). :class:`CapturedStep` packages that capture:
static input and target buffers, warm-up on a side stream undone before
the first step (:mod:`~mpstream.capture.state`), gradients kept in place,
the optimizer step inside the graph, and checks for the changes a replay
cannot see. Over a pipe whose stages replay graphs of their own
(``Pipe(graphs=True)``), the step is those graphs plus the zeroing and the
optimizer's update captured per device (:mod:`~mpstream.capture.devices`):
how a step on several GPUs is captured.

Without CUDA (every stage on the CPU) the same object runs the step eagerly
with the same checks, so code written against it runs anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from ..pipe.batchargs import batch_argument
from ..pipe.pipe import Pipe
from ..runtime.graphed.backends import pool_bytes
from ..runtime.graphed.state import storage_bytes
from .arguments import checked
from .buffers import fill, static, tensor
from .devices import DeviceGraphs
from .optimizer import check_optimizer, check_settings, hyperparameters
from .state import Kept, Trained
from .warmup import warm_up_and_capture

__all__ = ["CapturedStep"]


class CapturedStep:
    """One training step of a :class:`~mpstream.Pipe`, captured once, replayed per batch.

    The step is ``zero_grad`` (optional), ``pipe.train_step`` and
    ``optimizer.step()`` (optional), on buffers of the shapes given here.
    Constructing it on CUDA runs ``warmup`` steps on a side stream (lazy
    initialisation, cuDNN autotuning, optimizer state), captures one step
    there and puts parameters, buffers, gradients and optimizer state back,
    so the first call is the first step. Each call copies the batch into
    the static buffers and replays.

    What a replay cannot see, and therefore refuses or ignores:

    - shapes and dtypes are fixed: a batch of another shape raises (capture
      a second step for the last, smaller batch, sharing ``pool``, or drop it);
    - plain values in the batch and the optimizer's settings (lr, momentum,
      ...) are baked in: a call after one changed raises. For a learning-rate
      schedule, capture with a tensor ``lr`` on the parameters' device
      that the schedule changes in place, with an optimizer that reads it
      on the device at every step (``capturable=True``: Adam, AdamW, ...;
      on CUDA a tensor setting of an optimizer without it, or in host
      memory, is refused at construction);
    - with ``zero_grad=False`` gradients accumulate across calls in the
      captured gradient tensors: zero them with ``zero_grad(set_to_none=False)``;
      replacing a ``.grad`` (``set_to_none=True``), the optimizer's state
      (``load_state_dict``), a parameter or buffer (``assign=True``), its
      storage (``pipe.double()``) or a submodule, or switching a
      ``requires_grad``, makes the next call raise;
    - ``pipe.train()``/``eval()``, hooks and anything Python decides during
      the step keep the value they had at capture (over graphed stages,
      ``train_step``'s Python runs at every call, and the stages follow
      their own rules: ``docs/tuning.md``, Graphed stages).

    Warm-up is undone: parameters, buffers, gradients, optimizer state and
    the random number generators are put back (the pipe's, a loss module's
    and those of every parameter the optimizer steps). Optimizer state that warm-up
    created is zeroed, which is the first step's state for SGD (without
    dampening), Adam, AdamW, RAdam, Adamax, Adadelta and RMSprop; other
    optimizers need their state from one eager step before capture (refused
    otherwise).

    Two ways, chosen by the pipe:

    - a pipe of plain stages is captured as one graph, which runs the
      stages' work in one fixed interleaving: one launch per step. One
      graph cannot span devices, so the stages must share one GPU;
    - a pipe whose stages replay graphs of their own (``Pipe(graphs=True)``)
      keeps them: each call runs ``train_step``, whose tasks replay each
      stage's graphs on its device as the schedule orders them, between
      the zeroing and the optimizer's update, each captured as one graph
      per device (:class:`~mpstream.capture.devices.DeviceGraphs`). That is
      how a step on several GPUs is captured; :attr:`launches` counts the
      graphs a step launches. On one GPU one graph is the faster: at
      ResNet-101's split 8 on an H200, graphed stages took 1.07x-1.23x the
      step captured as one graph (docs/results/h200, before the graphs
      were thinned; docs/tuning.md).

    Every stage must sit on CUDA devices or on CPUs, where no graph exists
    and each call runs the step eagerly with the same checks (from the
    second call, once gradients exist). For mixed precision, construct it
    under ``torch.autocast(..., cache_enabled=False)`` (autocast's weight
    cache does not survive capture) with bfloat16: a ``GradScaler`` reads
    its overflow flag on the host, which a replay cannot. A capture keeps
    the autocast state it was made under; on CPUs, where each call runs
    eagerly, the state at the call applies instead (call it under the
    same ``autocast`` block).

    Args:
        pipe: the pipe to train.
        inputs: an example batch (what ``train_step`` takes); its tensors give
            the static buffers' shapes and dtypes, on the first stage's device.
        target: an example target, buffered on the last stage's device.
        loss_fn: ``loss_fn(output, target) -> scalar`` per micro-batch.
        optimizer: stepped inside the graph after the backward. Optimizers
            with a ``capturable`` option (Adam, AdamW, ...) need it ``True``
            on CUDA (PyTorch refuses it for CPU parameters:
            ``capturable=params_on_cuda``).
        reduction: as in :meth:`~mpstream.Pipe.train_step`.
        zero_grad: zero the gradients (in place) of the pipe, of a loss
            module and of every parameter the optimizer steps, at the
            start of every step.
        warmup: eager steps before capture (CUDA only); at least 1.
        pool: a graph memory pool to share (``torch.cuda.graph_pool_handle()``
            or another step's :attr:`pool`); not for a pipe with
            ``graphs=True``, whose stages keep pools of their own.

    Raises:
        TypeError: the batch spread into keywords (``CapturedStep(pipe, **batch)``:
            pass it as ``inputs``), ``pipe`` is not a Pipe, ``loss_fn`` is not callable,
            ``optimizer`` is not an optimizer, or ``warmup`` is not an int.
        ValueError: ``warmup`` below 1, an unknown ``reduction``, stages on
            several GPUs without ``graphs=True``, on both CPU and CUDA,
            ``pool`` with ``graphs=True``, a pipe being traced while it is
            captured as one graph (its scheduler's timing or plan recording
            is on: a replay would record nothing), an optimizer that steps
            none of the pipe's parameters (built on a copy of the model),
            or an optimizer whose captured step would differ from its eager
            one (see above).
        Exception: whatever capture raised (PyTorch's error, with a note);
            the pipe, the optimizer, the generators and the caller's stream
            are restored first.
    """

    @batch_argument("CapturedStep", "CapturedStep(pipe, inputs, target, loss_fn, ...)")
    def __init__(
        self,
        pipe: Pipe,
        inputs: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], Tensor],
        *,
        optimizer: torch.optim.Optimizer | None = None,
        reduction: str | None = None,
        zero_grad: bool = True,
        warmup: int = 3,
        pool: Any = None,
    ) -> None:
        given = checked(pipe, loss_fn, optimizer, reduction, warmup, pool)
        #: Whether the stages replay graphs of their own (``Pipe(graphs=True)``).
        self.graphed = given.graphed
        cuda, reduction = given.devices, given.reduction
        self.pipe, self.loss_fn, self.optimizer = pipe, loss_fn, optimizer
        self.reduction, self.zero_grad = reduction, bool(zero_grad)
        #: The GPUs the step runs on (empty: the CPU).
        self.devices = cuda
        #: The first of them (None: the CPU).
        self.device: torch.device | None = cuda[0] if cuda else None
        in_leaves, self._in_spec = pytree.tree_flatten(inputs)
        tgt_leaves, self._tgt_spec = pytree.tree_flatten(target)
        self._inputs = [static(x, pipe.devices[0]) for x in in_leaves]
        self._target = [static(x, pipe.devices[-1]) for x in tgt_leaves]
        check_optimizer(optimizer, cuda)
        self._settings = hyperparameters(optimizer)
        self._trained = Trained(pipe, loss_fn, optimizer)
        #: The step's one graph (None: on the CPU, or over graphed stages).
        self.graph: torch.cuda.CUDAGraph | None = None
        # Over graphed stages: the zeroing's and the update's graphs.
        self._zero: DeviceGraphs | None = None
        self._update: DeviceGraphs | None = None
        self._captured = False
        # Whether the captured kind of call changes an input in place (None:
        # not known before the first step on the CPU).
        self._changes: bool | None = None
        self._launches = 0
        self._kept: Kept | None = None
        self._loss: Tensor | None = None
        if self.device is not None:
            self._capture(warmup, pool)
            self._kept = Kept(self._trained, self.zero_grad)

    # -- the step ----------------------------------------------------------
    def _train(self, zeroed: bool = False) -> Tensor:
        """``train_step`` on the static buffers; ``zeroed``: the zeroing graph
        just ran, so a failure puts zeros back instead of a copy of every
        gradient taken per call."""
        with self._trained.undone_on_failure(zeroed):
            return self.pipe._train_step(
                pytree.tree_unflatten(self._inputs, self._in_spec),
                pytree.tree_unflatten(self._target, self._tgt_spec),
                self.loss_fn,
                self.reduction,
                None,
                zeroed,
            )

    def _step(self) -> Tensor:
        """One whole step, as Python issues it."""
        if self.zero_grad:
            self._trained.zero_grad()
        loss = self._train(zeroed=self.zero_grad)
        if self.optimizer is not None:
            self.optimizer.step()
        return loss

    def _capture(self, warmup: int, pool: Any) -> None:
        around = self._capture_around if self.graphed else None
        try:
            graph, self._loss = warm_up_and_capture(
                self._step, self.pipe, self._trained, self.devices, warmup, pool, self, around
            )
        except BaseException:
            self._zero = self._update = None
            raise
        self.graph, self._captured = graph, True
        self._changes = self.pipe._changes_inputs()

    def _capture_around(self) -> None:
        """Over graphed stages: captures the zeroing and the update per device
        (neither runs now), and counts the graphs one step replays."""
        trained = self._trained
        devices = list(dict.fromkeys(p.device for _, p in trained.params if p.is_cuda))
        if self.zero_grad:
            self._zero = DeviceGraphs(trained.zero_grad, devices)
        before = self.pipe.graph_report().replays
        self._train()  # runs: each call does so too
        stages = self.pipe.graph_report().replays - before
        if self.optimizer is not None:
            self._update = DeviceGraphs(self.optimizer.step, devices)
        around = [g.launches for g in (self._zero, self._update) if g is not None]
        self._launches = stages + sum(around)

    def __deepcopy__(self, memo: dict[int, Any]) -> CapturedStep:
        raise TypeError(
            "a CapturedStep holds a CUDA graph over its pipe's tensors and cannot be copied: "
            "copy the pipe and capture a new step for the copy"
        )

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "a CapturedStep holds a CUDA graph over its pipe's tensors and cannot be pickled: "
            "save the pipe's state_dict and capture a new step after loading"
        )

    @property
    def captured(self) -> bool:
        """Whether calls replay CUDA graphs (False: they run the step eagerly)."""
        return self._captured

    @property
    def launches(self) -> int:
        """Graph launches per step: 1 for one graph; over graphed stages, the
        stages' replays plus a zeroing and an update graph per device; 0
        when the step runs eagerly."""
        return 1 if self.graph is not None else self._launches

    @property
    def pool(self) -> Any:
        """The captured graph's memory pool, to share with another capture.

        Raises:
            RuntimeError: nothing was captured (the pipe runs on the CPU), or
                the stages replay graphs of their own (a pool per stage).
        """
        if self.graphed and self._captured:
            raise RuntimeError(
                "this step replays its stages' own graphs (graphs=True), each stage with "
                "pools of its own: there is no one pool to share"
            )
        if self.graph is None:
            raise RuntimeError("no CUDA graph was captured (the pipe runs on the CPU)")
        return self.graph.pool()

    @property
    def reserved_bytes(self) -> int:
        """Device memory the step's one graph holds in its pool (its
        activations and temporaries, reused by every replay; with ``pool=``
        shared, every graph's in that pool); over graphed stages, the pools
        of the zeroing's and the update's graphs per device (the optimizer's
        temporaries), the stages' own pools being their ``graph_report()``'s;
        0 on the CPU. What the step holds outside its pools is
        :attr:`static_bytes`."""
        if self.graph is not None:
            return pool_bytes(self.graph.pool())
        around = (g for d in (self._zero, self._update) if d is not None for g in d.graphs.values())
        return sum(pool_bytes(g.pool()) for g in around)

    @property
    def static_bytes(self) -> int:
        """Memory the step holds outside any graph pool that an eager step
        of the same pipe and optimizer does not: the static input and
        target buffers every call's batch is copied into, each storage
        counted once, on the first and the last stage's device (on the
        CPU too, where calls run eagerly but copy the batch in all the
        same).

        Not counted, because an eager step holds them at its peak too: the
        parameters and buffers, the gradients (which the step keeps
        between calls, where an eager ``zero_grad(set_to_none=True)``
        frees them) and the optimizer's state. Over graphed stages, what
        the stages' graphs hold outside their pools is their
        ``graph_report()``'s ``static_bytes``, not counted here."""
        held = (tensor(leaf) for leaf in (*self._inputs, *self._target))
        return storage_bytes(t for t in held if t is not None)

    # -- calls ---------------------------------------------------------------
    @batch_argument("CapturedStep", "step(inputs, target)")
    def __call__(self, inputs: Any, target: Any) -> Tensor:
        """Runs one step on ``inputs`` and ``target``.

        Args:
            inputs: a batch of the captured structure, shapes and dtypes, on
                any device (host memory is copied in; pinned memory
                without blocking the host, so do not refill a pinned
                batch before the step's loss is used, as with
                ``x.to(device, non_blocking=True)``).
            target: the targets, likewise.

        Returns:
            The whole-batch loss (a new tensor, on the last stage's device).

        Raises:
            TypeError: the batch spread into keywords (``step(**batch)``):
                pass it as ``inputs``.
            ValueError: a batch of another structure, shape or dtype, a plain
                value or an optimizer setting that changed since capture, a
                gradient, optimizer state or parameter replaced since
                capture, a replay of one graph while the pipe is being
                traced, or (as ``train_step``) an input sharing memory with
                one the forward changes in place.
        """
        check_settings(self._settings, self.optimizer)
        if self._kept is not None:
            self._kept.check()
        sched = self.pipe.scheduler
        if self.graph is not None and (sched.timing or sched.recording):
            raise ValueError(
                "CapturedStep: the pipe is being traced (mpstream.profile / trace turned its "
                "scheduler's timing or plan recording on), but a replay runs no Python and "
                "records nothing. Profile the pipe's eager train_step instead."
            )
        fill("inputs", self._inputs, self._in_spec, inputs)
        fill("target", self._target, self._tgt_spec, target)
        if self._changes is None or self._changes:
            # The static buffers are apart; the caller's inputs may share the
            # memory of one the forward changes in place: refused as
            # train_step refuses them.
            self.pipe._step_inputs(inputs, target)
        if not self._captured:
            loss = self._step()
            self._changes = self.pipe._changes_inputs()
            if self._kept is None:  # the CPU's checks start once gradients exist
                self._kept = Kept(self._trained, self.zero_grad)
            return loss
        assert self.device is not None
        with torch.cuda.device(self.device):
            if self.graph is not None:
                assert self._loss is not None
                self.graph.replay()
                return self._loss.clone()
            if self._zero is not None:
                self._zero.replay()
            loss = self._train(zeroed=self._zero is not None)
            if self._update is not None:
                self._update.replay()
            return loss

"""A training step, ``pipe.train_step(x, y, loss_fn)``: forward and backward
of every micro-batch in the schedule's order, the loss weighted per
micro-batch, and the pipe's state put back when it fails.

:class:`PipeStep` sits between :class:`~mpstream.pipe.call.PipeCall` (a call,
whose binding of arguments it shares) and :class:`~mpstream.Pipe` (its
construction). The run itself is :func:`~mpstream.runtime.training.run`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..runtime.errors import annotate
from ..runtime.graphed import generation
from ..runtime.microbatch import batch_device, scatter_sized
from ..runtime.stream import capturing
from ..runtime.training import run as run_step
from ..runtime.transfer import micro_staging
from ..stages.exported import own_loss
from .batchargs import batch_argument
from .call import PipeCall
from .inputs import detached, keywords_of
from .reduction import counted_mean, step_reduction
from .running import held, running_of
from .snapshot import Norms, Snapshot

__all__ = ["PipeStep", "StageDone", "averaged_by"]

# Pipes whose gradients a data-parallel wrapper averages over processes
# (mpstream.distributed.wrap): each wrapper, weakly (a pipe wrapped twice is
# refused while either lives), and why train_step alone must not run. Kept
# here rather than on the pipe, which pickles and copies.
_AVERAGED_BY: weakref.WeakKeyDictionary[nn.Module, list[tuple[weakref.ref[Any], str]]] = (
    weakref.WeakKeyDictionary()
)


def averaged_by(pipe: nn.Module, owner: object, why: str) -> None:
    """Makes ``pipe.train_step`` refuse to run while ``owner`` lives and a
    process group is initialised: ``owner`` averages the pipe's gradients
    over processes, which ``train_step`` alone would skip.

    Args:
        pipe: the pipe.
        owner: the wrapper (a ``DistributedDataParallel``), held weakly.
        why: the error's message: what happens, and what to call instead.
    """
    owners = [(ref, w) for ref, w in _AVERAGED_BY.get(pipe, ()) if ref() is not None]
    _AVERAGED_BY[pipe] = [*owners, (weakref.ref(owner), why)]


class StageDone(Protocol):
    """Told when each stage's gradients of a training step are final."""

    def __call__(self, stage: int) -> None:
        """Inside stage ``stage``'s last backward or weight task, on its stream."""

    def end(self) -> None:
        """Every task ran; still inside the step (a failure here undoes it)."""

    def abort(self) -> None:
        """The step failed: before its gradients are put back."""


class PipeStep(PipeCall):
    """Base of :class:`~mpstream.Pipe`: its training step."""

    @batch_argument(
        "Pipe.train_step",
        "pipe.train_step(batch) for a module computing its own loss, or "
        "pipe.train_step(inputs, target, loss_fn)",
    )
    def train_step(
        self,
        inputs: Any,
        target: Any = None,
        loss_fn: Callable[[Any, Any], Tensor] | None = None,
        *,
        reduction: str | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> Tensor:
        """Forward and backward of every micro-batch in :attr:`schedule` order.

        Gradients accumulate into ``.grad`` as if ``loss_fn`` had been applied
        to the whole batch: each micro-batch's loss is weighted by its share
        of the batch (``reduction='mean'``) or by 1 (``reduction='sum'``).
        The weights are exact for a loss that averages uniformly over the
        batch's rows. An ``nn.CrossEntropyLoss`` or ``nn.NLLLoss`` averaging
        class indices divides by a count that depends on the targets
        (``ignore_index``, class ``weight=``): the step sums each
        micro-batch's terms and divides by the whole batch's count (from
        the module's settings: its hooks are not called; a subclass is
        weighted by share). Any
        other loss averaging over such a count (a function) is not a
        weighted sum of its micro-batches' means: sum in it, give
        ``reduction='sum'``, and divide by the count yourself.
        Call ``optimizer.step()`` after. Only parameters get gradients:
        inputs and targets are detached. It is not a call of the pipe:
        forward hooks registered on the pipe itself do not run (those on
        its layers do).

        Args:
            inputs: the batch: one input, or a tuple of the module's
                positional inputs (split as :meth:`forward` splits them; a
                namedtuple is one input, as ``pipe(batch)`` takes it);
                for a traced module, a mapping (a dict, a ``BatchEncoding``)
                whose keys are strings, one at least naming a parameter of
                its ``forward``, is its keyword arguments (a Hugging Face
                batch).
            target: targets split the same way (any structure of tensors
                and plain values) and moved to the last stage's device;
                None with no ``loss_fn``.
            loss_fn: ``loss_fn(output, target) -> scalar`` per micro-batch.
                None: the module computes its loss itself (a Hugging Face
                model given ``labels``, split by ``torch.export``): each
                micro-batch's ``output.loss``, already weighted by its
                share of the batch, so ``reduction`` does not apply.
            reduction: how ``loss_fn`` reduces over the batch, ``'mean'``
                or ``'sum'``; default: a loss module's own (its
                ``reduction``), else ``'mean'``.
            scaler: a ``torch.amp.GradScaler``: each micro-batch's loss
                is scaled by ``scaler.scale`` before its backward, so the
                gradients are scaled; call ``scaler.step(optimizer)`` and
                ``scaler.update()`` after, as usual.

        Returns:
            The whole-batch loss (detached, unscaled), on the last stage's
            device.

        Raises:
            TypeError: the batch spread into keywords (``train_step(**batch)``:
                pass ``train_step(batch)``), bad inputs or targets, a stage returned an unsupported
                value, ``loss_fn`` is not callable, returned something other
                than a scalar tensor (or was not given for a module that
                returns no ``loss``), or ``scaler`` is not a ``GradScaler``.
            ValueError: empty batch, targets of another batch size, or an
                unknown ``reduction`` or one the loss module contradicts.
            RuntimeError: the pipe is wrapped in DistributedDataParallel
                by ``mpstream.distributed.wrap`` (its gradients would not
                be averaged: call ``mpstream.distributed.train_step``),
                called under ``torch.inference_mode()``,
                ``loss_fn`` returned a loss that does not require grad, or a
                call of the pipe is running already (in another thread, or
                this call comes from inside it: refused before it changes
                anything).

        Inputs and targets in host memory move in transfer tasks that never
        block the host (see :meth:`forward`). If anything raises, the
        gradients (a loss module's too, not those of other tensors
        ``loss_fn`` reads) and BatchNorm statistics are restored to what
        they were before the call (not the random number generators: a
        failed step has drawn what it drew). For that, each stage's existing
        gradients (under gradient accumulation) are cloned on its stream when its first
        backward of the step begins; a step that starts with no gradients,
        or fails before the backward, clones nothing. A step being captured
        in a CUDA graph (:class:`~mpstream.CapturedStep`) takes no snapshot:
        capture cannot be undone by running restores; one that
        ``CapturedStep`` runs right after zeroing the gradients clones none
        (a failure zeroes them again).
        """
        for owner, why in _AVERAGED_BY.get(self, ()):
            if owner() is not None and dist.is_initialized():
                raise RuntimeError(why)
        return self._train_step(inputs, target, loss_fn, reduction, scaler)

    @held("train_step")
    def _train_step(
        self,
        inputs: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], Tensor] | None,
        reduction: str | None,
        scaler: torch.amp.GradScaler | None,
        zeroed: bool = False,
        stage_done: StageDone | None = None,
    ) -> Tensor:
        """:meth:`train_step`. ``zeroed``: every existing gradient is known to
        be zero (:class:`~mpstream.CapturedStep` replayed its zeroing just
        before), so the failure snapshot copies none and zeroes them back.
        ``stage_done``: called with a stage's index inside its last
        gradient task (``mpstream.distributed`` starts its all-reduces
        there), its ``end()`` once every task ran, its ``abort()`` before a
        failed step is put back; the pipe is held for the call."""
        if torch.is_inference_mode_enabled():
            raise RuntimeError(
                "train_step was called under torch.inference_mode(), where nothing can be "
                "trained; call it outside that block (it enables gradients itself, so under "
                "torch.no_grad() it works)"
            )
        self.scheduler.start_call()  # a device left broken, named; then after the last call's reads
        given = (inputs, target, loss_fn)  # what schedule='auto' profiles, as given
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be callable (loss_fn(output, target) -> scalar) or None, got "
                f"{type(loss_fn).__name__}"
            )
        if loss_fn is not None:
            reduction = step_reduction(reduction, loss_fn)
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        # Parameter gradients only: inputs are detached, so whether x.grad
        # fills cannot depend on where the batch sits.
        split = self.__dict__["_split"]
        args = self._step_inputs(inputs, target)
        if loss_fn is None:
            loss_fn, reduction = own_loss(split, target), "sum"
        args = detached(args)
        target = detached(target)
        step_loss, reduction, target = counted_mean(loss_fn, reduction, target)
        micro, sizes = scatter_sized(args, self._chunks, self._split_size)
        if len(micro) == 1:
            self._say_one_micro_batch(sizes[0], "train_step")
        if target is None:
            micro_targets, target_sizes = [None] * len(micro), sizes
        else:
            micro_targets, target_sizes = scatter_sized(
                target, self._chunks, self._split_size, "target"
            )
        batch = sum(sizes)
        if target_sizes != sizes:
            raise ValueError(
                f"target has batch size {sum(target_sizes)} but inputs have {batch}"
                if sum(target_sizes) != batch
                else f"target splits into micro-batches {target_sizes}, inputs into {sizes}"
            )
        weights = [n / batch if reduction == "mean" else 1.0 for n in sizes]
        with running_of(self).nesting():  # 'auto' measures steps of this pipe
            self._choices().choose(self, *given, tuple(sizes))
        schedule = self.schedule_for(
            len(micro),
            batch_device(args),
            training_step=True,
            target_device=None if target is None else batch_device(target),
        )
        worker = self._rt().worker
        chunks, size = self._chunks, self._split_size
        staging = micro_staging(args, self.devices[0], chunks, size)
        target_staging = (
            None if target is None else micro_staging(target, self.devices[-1], chunks, size)
        )
        # Under CUDA graph capture a snapshot's clones would be recorded, not
        # run, and then run on every replay, holding a copy of every gradient.
        graphs = worker.graphs
        snapshot = None
        if not capturing(self.devices):
            norms, params = self._norms(), self._stage_params()
            try:
                saved = graphs.save(zeroed) if graphs is not None else None
                snapshot = Snapshot(norms, params, loss_fn, saved, zeroed)
            except BaseException:
                if graphs is not None:
                    graphs.restore(keep=True)  # else its save stays pending, copies held
                raise
        try:
            with torch.enable_grad():
                stop = self._prepare(len(micro))
                loss = run_step(
                    worker,
                    micro,
                    micro_targets,
                    schedule,
                    step_loss,
                    weights,
                    stop,
                    staging,
                    target_staging,
                    None if snapshot is None else snapshot.save_grads,
                    None if scaler is None else scaler.scale,
                    stage_done,
                    self._deferred_norms(),
                )
            if stage_done is not None:
                stage_done.end()  # inside: a failure there is undone with the step
        except BaseException as exc:
            if stage_done is not None:
                try:
                    stage_done.abort()
                except BaseException as cleanup:  # the restore below must still run
                    annotate(
                        exc, f"mpstream: waiting for the gradients' reduction raised: {cleanup!r}"
                    )
            if snapshot is not None:
                # Each restore on its own: one raising (a sticky device error)
                # must not leave the other's state half put back.
                restores = [snapshot.restore]
                if graphs is not None:
                    restores.insert(0, functools.partial(graphs.restore, keep=False))
                for restore in restores:
                    try:
                        restore()
                    except Exception as cleanup:  # exc stays the one raised
                        annotate(exc, f"mpstream: restoring the state raised too: {cleanup!r}")
            raise
        finally:
            self._finish()
        if graphs is not None:
            graphs.restore(keep=True)
        return loss

    def _norms(self) -> Norms:
        """The pipe's BatchNorm buffers for a step's snapshot, found again only
        when a module registered something or a buffer moved."""
        found = self.__dict__.get("_norm_buffers")
        now = generation()
        if found is None or found[0] != now or found[1].stale():
            found = (now, Norms(self))
            self.__dict__["_norm_buffers"] = found
        return found[1]  # type: ignore[no-any-return]

    def _stage_params(self) -> list[list[nn.Parameter]]:
        """Each stage's parameters, found again only when a module
        registered something or a traced pipe switched to another kind's
        split (a walk over every module costs)."""
        found = self.__dict__.get("_param_lists")
        parts = self.__dict__["_partitions"]
        now = (generation(), id(parts))
        if found is None or found[0] != now:
            found = (now, [list(part.parameters()) for part in parts])
            self.__dict__["_param_lists"] = found
        return found[1]  # type: ignore[no-any-return]

    def _step_inputs(self, inputs: Any, target: Any = None) -> tuple[Any, ...]:
        """``train_step``'s ``inputs`` as the pipeline's positional inputs (a
        traced module switched to the split of their kind), checked against
        ``target`` too (see :meth:`_inputs`)."""
        split = self.__dict__["_split"]
        root = self.__dict__["_root"]
        if isinstance(inputs, Mapping) and split is not None and keywords_of(root, inputs):
            # Keyword arguments (a Hugging Face batch, a tokenizer's BatchEncoding).
            return self._inputs((), dict(inputs), target)
        if split is not None and isinstance(inputs, tuple) and not hasattr(inputs, "_fields"):
            # A namedtuple is a batch (pipe(batch) takes it so), not the arguments.
            return self._inputs(inputs, {}, target)
        return self._inputs((inputs,), {}, target)

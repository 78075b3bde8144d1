"""A pipeline call, ``pipe(x)``: inputs bound, scattered, run fill-drain, gathered.

:class:`PipeCall` sits between :class:`~mpstream.pipe.config.PipeConfig`
(the configuration and the runtime) and :class:`~mpstream.Pipe` (its
construction and the training step): ``forward``, and how a call's
arguments become the pipeline's inputs, which ``train_step`` shares. A
traced module first switches to the split of the call's kind (see
:mod:`~mpstream.stages.kinds`), with its own stages and runtime; a module
exported at its first call (no ``sample=``) gets its first split so.
A call with gradients that runs its batch as one micro-batch through
several stages, where nothing can overlap, is told so once per pipe
(:class:`SingleMicroBatchWarning`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .._warn import warn
from .._words import count_of
from ..runtime.forward import run as run_forward
from ..runtime.gathering import gather
from ..runtime.microbatch import batch_device, scatter_sized
from ..runtime.transfer import micro_staging
from .config import PipeConfig
from .inputs import check_holds_tensor, positional
from .running import held

__all__ = ["PipeCall", "SingleMicroBatchWarning", "warned_as_before"]


class SingleMicroBatchWarning(UserWarning):
    """A call with gradients ran its batch through several stages as one
    micro-batch: each stage waited for the one before it, nothing
    overlapped."""


@contextmanager
def warned_as_before(pipe: PipeCall) -> Iterator[None]:
    """The block's calls leave the pipe's once-per-pipe warning as it was:
    a measurement's tries (tune's curve points, one micro-batch among them
    on purpose) do not use up what a later call of the user's would say."""
    said = pipe.__dict__.get("_said_one_micro_batch", False)
    try:
        yield
    finally:
        pipe.__dict__["_said_one_micro_batch"] = said


class PipeCall(PipeConfig):
    """Base of :class:`~mpstream.Pipe`: a call of the pipeline.

    Expects what :class:`~mpstream.pipe.config.PipeConfig` does.
    """

    @held("pipe(x)")
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the pipeline on a batch.

        Args:
            *args: the inputs, as the wrapped module takes them (and
                ``**kwargs`` for a traced module). Every tensor is split
                along dim 0 into micro-batches (all into as many);
                :class:`~mpstream.NoChunk` tensors and plain values (int,
                float, bool, str, None) reach every micro-batch whole. A
                Sequential's first layer gets the inputs as positional
                arguments, and each layer the previous one's output: a tuple
                spread into positional arguments when the layer takes
                several. Inputs may sit on the CPU or on any device. Host
                memory moves to the device in transfer tasks on its io
                stream, which never block the host: pageable tensors pass
                through pinned buffers (a host copy of the batch per step),
                pinned ones (``DataLoader(pin_memory=True)``) move directly,
                as ``x.to(device, non_blocking=True)`` would: do not
                overwrite a pinned batch before the output is used. When an
                input requires grad, its gradient comes back asynchronously
                and the backward call returns once it is in place.

        Returns:
            The output on the last stage's device: tensors concatenated along
            dim 0, plain values listed per micro-batch, in the structure the
            module returns. For a module split by ``torch.export`` that
            returns its own scalar ``loss`` (a Hugging Face model given
            ``labels``), the micro-batches' losses are weighted by their
            share of the batch and summed: the batch's loss.

        Raises:
            TypeError: no tensor to split, an unsupported input or stage
                output (the stage is named), keyword arguments to a
                Sequential pipe; ``torch.export`` could not export a call
                of a new kind (the first one too, for a pipe built without
                ``sample=``: it then stays unsplit, and the next call tries
                again).
            ValueError: an empty batch, or tensors of different batch sizes
                (wrap one meant whole in :class:`~mpstream.NoChunk`).
            RuntimeError: a call of the pipe is running already (in another
                thread, or this call comes from inside it): refused before
                it changes anything.

        An exception raised in a stage reaches the caller unchanged, with a
        note naming the stage, micro-batch and task (a backward that autograd
        runs later raises from its engine, without a note); the statistics a
        :class:`~mpstream.memory.batchnorm.DeferredBatchNorm` had accumulated for
        the failed batch are dropped (they update only once all stages finish).
        """
        self.scheduler.start_call()  # a device left broken, named; then after the last call's reads
        inputs = self._inputs(args, kwargs)
        micro, sizes = scatter_sized(inputs, self._chunks, self._split_size)
        if len(micro) == 1 and torch.is_grad_enabled():
            self._say_one_micro_batch(sizes[0], "pipe(x) with gradients")
        schedule = self.schedule_for(len(micro), batch_device(inputs))
        worker = self._rt().worker
        staging = micro_staging(inputs, self.devices[0], self._chunks, self._split_size)
        stop = self._prepare(len(micro))  # raising, it leaves no hook
        try:
            norms = self._deferred_norms()
            outputs = run_forward(worker, micro, schedule, stop, staging, norms)
        finally:
            self._finish()
        split = self.__dict__["_split"]
        return gather(outputs) if split is None else split.gather(outputs)

    def _say_one_micro_batch(self, rows: int, call: str) -> None:
        """Warns, once per pipe of several stages, that ``call`` ran its
        batch (of ``rows`` rows, one micro-batch) with no overlap, and what
        to do; at the user's line, whichever public call led here."""
        stages = len(self.devices)
        if stages < 2 or self.__dict__.get("_said_one_micro_batch"):
            return
        self.__dict__["_said_one_micro_batch"] = True
        if self._chunks == 1:
            why = "chunks=1"
        elif self._chunks is not None:
            why = f"chunks={self._chunks}, but the batch has one row"
        elif self._split_size is not None:
            why = f"split_size={self._split_size} >= the batch's {count_of(rows, 'row')}"
        else:
            why = "the pipe was built with neither chunks nor split_size"
        warn(
            f"mpstream: {call} ran the batch of {count_of(rows, 'row')} as one micro-batch through "
            f"{stages} stages ({why}): each stage waits for the one before it, so nothing "
            f"overlaps and the pipeline is no faster than a single device. Split the batch into "
            f"micro-batches (chunks=, at least {stages} for every stage to be busy at once, or a "
            f"split_size below the batch size) or give it a larger batch. (Warned once per "
            f"pipe.)",
            SingleMicroBatchWarning,
        )

    def _inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any = None
    ) -> tuple[Any, ...]:
        """The pipeline's positional inputs for a call; a traced module first
        switches to the split of the call's kind. Refused where an input the
        forward changes in place shares memory with another, or with
        ``train_step``'s ``target``."""
        state = self.__dict__
        split = state["_split"]
        if split is None:
            return positional(args, kwargs)
        check_holds_tensor(args, kwargs, state["_root"])
        chosen, inputs = split.select(args, kwargs)
        chosen.changed.check(type(split.module).__name__, inputs, target)
        if state["_graph"] is not chosen.graph:
            runtime = state["_runtime"]
            split.enter(chosen, self.schedule, self.virtual_stages, self.training, runtime)
            state["_partitions"] = chosen.modules
            state["_graph"] = chosen.graph
            state["_balance"] = chosen.balance
            state["_runtime"] = chosen.runtime
        else:
            split.refresh()
        return inputs  # type: ignore[no-any-return]

    def _changes_inputs(self) -> bool:
        """Whether the current split's forward changes an input in place
        (its calls are checked for inputs sharing memory with it)."""
        split = self.__dict__["_split"]
        current = None if split is None else split.current
        return current is not None and bool(current.changed.paths)

"""A Pipe over a module split by ``torch.export``: one split per kind of call.

An exported program is fixed to one kind of call (see :mod:`~mpstream.stages.export`):
which arguments were given, their plain values and their shapes but the
batch dimension, the modules' training flags (dropout) and the dtypes.
:class:`ExportSplit` keeps the split of each kind met so far. The first is
exported when the pipe is built, from ``sample=`` (or a Hugging Face model's
``dummy_inputs``), or else at the pipe's first call, whose arguments are
the example: an export needs one, and that call is one. Exporting places the
module's tensors on the stages' devices; a call of another kind is exported
when it first comes (the same split points, placement checked) and the pipe
switches to its stages, stage graph and runtime (see
:mod:`~mpstream.stages.kinds`). Micro-batches of any size
run the same split: the batch dimension is left symbolic. :meth:`ExportSplit.report` is what
:meth:`mpstream.Pipe.split_report` returns for such a pipe.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ..runtime.microbatch import NoChunk
from .export import (
    ExportedStages,
    ExportGraphError,
    export_stages,
    retarget_devices,
    split_candidates,
)
from .fake_export import first_line
from .hf import Calls, calls_for
from .kinds import Kinds, Split, operations
from .model_loss import gather_with_loss
from .module_hooks import HookError, check_traced_hooks, check_unsized, entering
from .placement import place
from .points import SplitPointError, check_named
from .replaced import check_forwards
from .tracers import CallSignature, SplitReport, describe_call, raised_in, sample_call

__all__ = ["ExportSplit", "own_loss"]


@dataclass
class _Split(Split):
    """The split for one kind of call: what the export fixed of the call."""

    key: Any
    stages: ExportedStages
    nochunk: list[bool]

    def fits(self, items: Sequence[Any]) -> bool:
        """Whether a call's input leaves are of this split's kind."""
        if len(items) != len(self.stages.patterns):
            return False
        for leaf, pattern, nochunk in zip(items, self.stages.patterns, self.nochunk):
            if isinstance(leaf, NoChunk) != nochunk:
                return False
            if pattern[0] == "tensor":
                t = leaf.tensor if isinstance(leaf, NoChunk) else leaf
                if not isinstance(t, Tensor) or t.dtype != pattern[1] or t.dim() != len(pattern[2]):
                    return False
                start = 0 if nochunk else 1  # micro-batches differ in dim 0
                fixed = zip(pattern[2][start:], t.shape[start:])
                if any(p is not None and p != n for p, n in fixed):
                    return False
            elif type(leaf) is not pattern[1] or leaf != pattern[2]:
                return False
        return True


@dataclass
class ExportSplit(Kinds):
    """A module pipelined by ``torch.export``.

    Args:
        module: the module (its tensors are placed on the stages' devices).
        split_points: where the stages begin.
        devices: one device per stage.
        reason: why ``torch.export`` splits it (for the report).
        fx_error: what ``torch.fx`` raised, when it was tried first.
    """

    module: nn.Module
    split_points: list[str]
    devices: list[torch.device]
    reason: str
    fx_error: BaseException | None = None
    calls: Calls = field(init=False)
    splits: list[_Split] = field(default_factory=list)
    current: _Split | None = None

    def __post_init__(self) -> None:
        self.calls = calls_for(self.module)
        self.signature = CallSignature(self.module)

    # -- a kind of call -------------------------------------------------
    def first(self, sample: Any) -> _Split | None:
        """Exports the split for ``sample`` (a call, see :func:`sample_call`)
        in the module's mode and places the module's tensors; without one
        (nor a family's stand-in, see :meth:`~mpstream.stages.hf.Calls.sample`),
        nothing: the first call is exported when it comes (:meth:`select`).

        Returns:
            The split, or None when the first call is to be the example.

        Raises:
            TypeError: export failed; a module the export entered holds a
                hook (see :mod:`~mpstream.stages.module_hooks`).
            SplitPointError: a split point names no submodule, or (exported)
                cannot cut the forward.
        """
        check_unsized(self.module, self.module.modules(), "export")
        if sample is None:
            sample = self.calls.sample(self.module)
        if sample is None:
            # Until the first call, only the names can be checked.
            check_named(self.module, self.split_points, split_candidates)
            return None
        check_forwards(self, self.module, self.module.modules(), "torch.export")
        args, kwargs = sample_call(sample)
        named = self.calls.prepare(self.signature(args, kwargs))
        items, spec = pytree.tree_flatten(((), named))
        split = self._export(named, (spec, self._state()), items)
        self.current = split
        return split

    def _state(self) -> tuple[Any, ...]:
        """What an export fixes of the module: training flags and dtypes."""
        flags = tuple(m.training for m in self.module.modules())
        tensors = itertools.chain(self.module.parameters(), self.module.buffers())
        return flags, tuple(sorted({str(t.dtype) for t in tensors}))

    def _export(self, named: dict[str, Any], key: Any, items: Sequence[Any]) -> _Split:
        check_unsized(self.module, self.module.modules(), "export")
        try:
            with entering(self.module, "export") as entered:
                stages = export_stages(
                    self.module, self.split_points, named, self.devices[0],
                    weigh=self.calls.weighs_loss(named),
                )  # fmt: skip
        except (SplitPointError, ExportGraphError, HookError):
            raise
        except ValueError as exc:
            if not _raised_by_torch(exc):  # the model's own check of its inputs
                raise
            _check_batch_sizes(items, exc)
            raise TypeError(self._failure(exc)) from exc
        except Exception as exc:
            _check_batch_sizes(items, exc)
            raise TypeError(self._failure(exc)) from exc
        nochunk = [isinstance(x, NoChunk) for x in items]
        holders = list(pytree.tree_flatten_with_path(((), named))[0])
        for (path, leaf), pattern, whole in zip(holders, stages.patterns, nochunk):
            if isinstance(leaf, Tensor) and not whole and leaf.dim() and pattern[2][0] is not None:
                raise TypeError(
                    f"torch.export fixed the batch dimension of input "
                    f"{pytree.keystr(path)} to {pattern[2][0]}: "
                    f"{type(self.module).__name__}'s code depends on the batch size, so it "
                    f"cannot run on micro-batches of other sizes"
                )
        split = _Split(
            key,
            stages,
            nochunk,
            modules=nn.ModuleList(stages.partitions),
            balance=operations(stages.partitions),
            graph=stages.graph,
            changed=stages.changed,
            described=describe_call(named, bool(self.module.training), key[1][1]),
            entered=tuple(entered),
        )
        self._place(split)
        self.splits.append(split)
        return split

    def _failure(self, exc: BaseException) -> str:
        name = type(self.module).__name__
        where = raised_in(exc, self.module)
        inside = f" inside submodule '{where}'" if where else ""
        leaf = where or "name"
        fx = (
            f"torch.fx could not trace it either: {first_line(self.fx_error)}\n"
            if self.fx_error is not None
            else ""
        )
        return (
            f"torch.export could not export {name}{inside}: {first_line(exc)}\n{fx}"
            f"The usual cause is data-dependent control flow (a Python branch on a tensor's "
            f"values), which neither tracer follows: compute it with tensor operations "
            f"(torch.where, torch.cond), move it out of the forward, "
            f"{self.calls.export_advice(leaf)}, or pass an nn.Sequential of stages. A call the "
            f"module itself cannot run (inputs of the wrong shape or dtype) fails here too: "
            f"the export runs the module on the call's arguments."
        )

    def _place(self, split: _Split) -> None:
        """Puts the tensors each stage reads on its device (see
        :func:`~mpstream.stages.placement.place`) and makes each stage
        create tensors there.

        Raises:
            ValueError: a tensor read by stages on different devices, or
                placed on another device by an earlier split.
        """
        stages = split.stages
        earlier = [s.stages.tensors for s in self.splits]
        place(self.module, stages.partitions, stages.tensors, self.devices, earlier)
        for s, part in enumerate(stages.partitions):
            retarget_devices(part, stages.device, self.devices[s])

    # -- every call -----------------------------------------------------
    def select(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Split, tuple[Any, ...]]:
        """The split of a call's kind (exported now if it is new) and the
        pipeline's inputs for the call. The module's training flags, which
        :meth:`mpstream.Pipe.train` sets, are part of the kind.

        Args:
            args: the call's positional arguments.
            kwargs: its keyword arguments.

        Raises:
            TypeError: the call does not bind to ``forward``; export failed;
                a module the call's export entered holds a hook (see
                :mod:`~mpstream.stages.module_hooks`), or a module has another
                instance ``forward`` than it had (see :mod:`~mpstream.stages.replaced`).
            ValueError: the family refuses the call (see :mod:`~mpstream.stages.hf`).
        """
        check_forwards(self, self.module, self.module.modules(), "torch.export")
        named = self.calls.prepare(self.signature(args, kwargs))
        items, spec = pytree.tree_flatten(((), named))
        key = (spec, self._state())
        split = next((s for s in self.splits if s.key == key and s.fits(items)), None)
        if split is None:
            split = self._export(named, key, items)
        modules = self.module.modules() if split.entered is None else split.entered
        check_traced_hooks(self.module, modules, "export")
        inputs = tuple(items)
        loss = split.stages.loss
        if loss is not None:
            batch = next((x.size(0) for x in items if isinstance(x, Tensor) and x.dim()), None)
            if batch is None:
                raise TypeError("the input holds no tensor to split into micro-batches")
            inputs += (loss.shares(items, batch),)
        return split, inputs

    def gather(self, outputs: Sequence[Any]) -> Any:
        """The micro-batches' outputs joined (see :mod:`~mpstream.stages.model_loss`)."""
        return gather_with_loss(outputs)

    def report(self) -> SplitReport:
        """Which tracer split the module, why, and each kind of call exported."""
        reason = self.reason
        if self.fx_error is not None:
            reason = f"torch.fx could not trace it ({first_line(self.fx_error)})"
        return SplitReport(
            "torch.export",
            reason,
            tuple(self.split_points),
            tuple(s.described for s in self.splits),
            tuple(
                f"{s.described.split(':')[0]}: weighted {s.stages.loss.how}"
                for s in self.splits
                if s.stages.loss is not None
            ),
        )


def own_loss(split: Kinds | None, target: Any) -> Callable[[Any, Any], Tensor]:
    """``train_step``'s loss when no ``loss_fn`` is given: the ``loss`` the
    module returns (weighted per micro-batch, see :mod:`~mpstream.stages.model_loss`).

    Raises:
        TypeError: the pipe was not split by ``torch.export``, or a target
            was given without a ``loss_fn``.
    """
    if not isinstance(split, ExportSplit):
        raise TypeError(
            "train_step needs a loss_fn: only a module split by torch.export that computes its "
            "own loss (a Hugging Face model given labels) trains without one"
        )
    if target is not None:
        raise TypeError("a target was given without a loss_fn; give loss_fn(output, target)")
    name = type(split.module).__name__

    def model_loss(output: Any, _: Any) -> Tensor:
        loss = output.get("loss") if isinstance(output, Mapping) else None
        if not isinstance(loss, Tensor):
            raise TypeError(
                f"{name} returned no loss to train on (a Hugging Face model computes one when "
                f"given labels=); pass labels, or a loss_fn"
            )
        return loss

    return model_loss


def _check_batch_sizes(items: Sequence[Any], exc: BaseException) -> None:
    """Names inputs of different batch sizes as the cause of a failed export
    (torch.export gives each its own symbolic size, and the model's check
    that they match fails in torch's words).

    Raises:
        ValueError: the tensors to split differ in size along dim 0.
    """
    sizes = sorted({x.size(0) for x in items if isinstance(x, Tensor) and x.dim()})
    if len(sizes) > 1:
        raise ValueError(
            f"input tensors have different batch sizes (dim 0): {sizes}, and torch.export "
            f"could not export the call ({first_line(exc)}); mpstream splits every tensor "
            f"along dim 0 into micro-batches. Give them the same batch size, or wrap those "
            f"not to split in mpstream.NoChunk"
        ) from exc


_TORCH = os.path.dirname(torch.__file__) + os.sep


def _raised_by_torch(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside torch (torch.export refusing the
    model), not by the model's own code (a check of its inputs, which
    reaches the user as it is)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(_TORCH)

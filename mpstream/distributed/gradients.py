"""Averaging a pipeline's gradients over DDP's process group, stage by stage.

A stage's gradients are final once its last backward (or weight) task of a
step has run: :class:`StageReducer` is called there, inside that task on the
stage's stream, and issues the stage's all-reduces at once, so they run
while the earlier stages still compute their backward (as DDP overlaps its
buckets with autograd). :meth:`StageReducer.finish` waits for them after
the step and divides by the group's size.

Every process issues the same collectives in the same order: the stages
finish in the schedule's order, and a stage's gradients are reduced as one
flat tensor per device and dtype (its parameters in order), cut into chunks
of DDP's bucket size, whichever way the stage keeps them. A graphed stage's
gradient buffers (``Pipe(graphs=True)``) are that flat tensor already and
are reduced in place; an eager stage's gradients are concatenated first and
copied back after. A parameter without a gradient contributes zeros, and
which parameters had one is all-reduced beside, so that after the step a
parameter with a gradient on some processes gets the average with zeros
and one with a gradient nowhere keeps ``grad=None`` (DDP's
``find_unused_parameters`` rule). Parameters two stages share (tied), and
any not in a stage, are reduced at :meth:`~StageReducer.finish`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ..pipe.pipe import Pipe
from ..runtime.graphed.grads import GradStore
from ..runtime.stream import current_stream, record_stream

__all__ = ["StageReducer", "sync_gradients"]

# Bucket size for gradient collectives when DDP does not say (DDP's own default).
BUCKET_BYTES = 25 * 1024 * 1024


@dataclass
class _Group:
    """One stage's parameters of one device and dtype, reduced as one flat tensor."""

    params: list[nn.Parameter]
    flat: Tensor
    views: list[Tensor] | None  # where the gradients were copied from (None: the buffers)
    works: list[Any] = field(default_factory=list)


class StageReducer:
    """Averages each stage's gradients over ``ddp``'s group as the stage ends.

    Call it with a stage's index inside that stage's last gradient task of a
    step, then :meth:`finish` after the step; :meth:`abort` instead, before
    anything is put back, if the step failed.

    Args:
        ddp: the DistributedDataParallel module around the pipe; every
            process of its group must run the same steps.

    Raises:
        ValueError: a gradient is sparse (when its stage ends).
    """

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.pipe: Pipe = ddp.module
        self.group = ddp.process_group
        self.size = dist.get_world_size(self.group)
        self.cap = int(getattr(ddp, "bucket_bytes_cap", BUCKET_BYTES))
        self.ignored = set(ddp.parameters_to_ignore)
        self.issued: list[tuple[list[_Group], GradStore | None]] = []
        self.done: set[int] = set()
        self._stages: tuple[list[list[nn.Parameter]], list[nn.Parameter]] | None = None
        self.names: dict[int, str] = {}

    def stages(self) -> tuple[list[list[nn.Parameter]], list[nn.Parameter]]:
        """Per stage, the parameters reduced as it ends; and the rest (tied,
        or in no stage), reduced at :meth:`finish`. Found at first use: a
        traced pipe is split by its first call."""
        if self._stages is None:
            named = list(self.pipe.named_parameters())
            self.names = {id(p): n for n, p in named}
            synced = {id(p) for n, p in named if p.requires_grad and n not in self.ignored}
            per_stage = [_unique(part.parameters()) for part in self.pipe.partitions]
            seen: dict[int, int] = {}
            for params in per_stage:
                for p in params:
                    seen[id(p)] = seen.get(id(p), 0) + 1
            # A tied parameter is final only once both its stages ended.
            stages = [[p for p in ps if id(p) in synced and seen[id(p)] == 1] for ps in per_stage]
            staged = {id(p) for ps in stages for p in ps}
            rest = [p for _, p in named if id(p) in synced and id(p) not in staged]
            self._stages = (stages, _unique(iter(rest)))
        return self._stages

    def __call__(self, stage: int) -> None:
        """Issues stage ``stage``'s all-reduces (after the current stream's work)."""
        if stage not in self.done:
            self.done.add(stage)
            self._issue(self.stages()[0][stage], self.pipe._grad_stores()[stage])

    def _issue(self, params: list[nn.Parameter], store: GradStore | None) -> None:
        if not params:
            return
        for p in params:
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError(
                    f"gradient of {self.names.get(id(p), 'a parameter')} is sparse; mpstream "
                    f"reduces dense gradients"
                )
        layout = _by_layout(params)
        flats = _store_flats(store, layout)
        groups: list[_Group] = []
        with torch.no_grad():
            if flats is not None:
                assert store is not None
                # A parameter whose .grad is not its view contributes that
                # tensor (set by hand) or nothing; the view's stale values must not.
                owned = store.owned()
                absent = [v for p, v in owned if p.grad is None]
                if absent:
                    torch._foreach_zero_(absent)
                for p, v in owned:
                    if p.grad is not None and p.grad is not v:
                        v.copy_(p.grad)
                groups = [_Group(ps, flat, None) for ps, flat in zip(layout, flats)]
            else:
                for ps in layout:
                    flat, views = _laid_out(ps)
                    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps]
                    torch._foreach_copy_(views, grads)
                    groups.append(_Group(ps, flat, views))
            for g in groups:
                step = max(1, self.cap // g.flat.element_size())
                for start in range(0, g.flat.numel(), step):
                    chunk = g.flat[start : start + step]
                    g.works.append(dist.all_reduce(chunk, group=self.group, async_op=True))
        self.issued.append((groups, store if flats is not None else None))

    def finish(self) -> None:
        """After the step: the remaining parameters reduced, every all-reduce
        waited for (on the current stream) and averaged, then which
        parameters had a gradient anywhere (one more all-reduce), and the
        averages written back."""
        self._issue(self.stages()[1], None)
        issued, self.issued = self.issued, []
        if not issued:
            return
        params = [p for groups, _ in issued for g in groups for p in g.params]
        with torch.no_grad():
            for groups, _ in issued:
                for g in groups:
                    for w in g.works:
                        w.wait()
                    if g.views is not None:  # made on a stage's stream, read on this one
                        record_stream(g.flat, current_stream(g.flat.device))
                    g.flat.div_(self.size)
            flags = [p.grad is not None for p in params]
            present = torch.tensor(flags, dtype=torch.int32, device=params[0].device)
            dist.all_reduce(present, group=self.group)
            anywhere = {id(p) for p, n in zip(params, present.tolist()) if n}
            for groups, store in issued:
                for g in groups:
                    if g.views is None:
                        continue
                    for p, view in zip(g.params, g.views):
                        if id(p) not in anywhere:
                            continue
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        p.grad.copy_(view)
                if store is not None:  # a gradient from elsewhere: .grad is the view again
                    for p, v in store.owned():
                        if p.grad is not v and id(p) in anywhere:
                            p.grad = v

    def abort(self) -> None:
        """After a failed step: waits for what was issued (every process
        issued it, or the group's timeout ends the wait), so nothing writes
        into the gradients the step puts back."""
        issued, self.issued = self.issued, []
        for groups, _ in issued:
            for g in groups:
                for w in g.works:
                    w.wait()


def sync_gradients(ddp: DistributedDataParallel) -> None:
    """Averages the ``.grad`` of the wrapped module's parameters over ``ddp``'s group.

    Parameters that do not require grad, and those DDP was told to ignore,
    are left alone. A parameter with a gradient on some processes only gets
    the average of the others' with zeros (DDP's ``find_unused_parameters``
    rule); one without a gradient anywhere keeps ``grad=None``. Graphed
    stages' gradient buffers (``Pipe(graphs=True)``: the parameters'
    ``.grad`` are views of one flat buffer per stage and dtype) are reduced
    in place, in chunks of the bucket size, with no copy; the other
    gradients are flattened per stage, device and dtype. All of the
    all-reduces are issued before the first is waited for.
    :func:`~mpstream.distributed.train_step` issues each stage's as the
    stage ends instead.

    Args:
        ddp: a DistributedDataParallel module; every process of its group
            must call this.

    Raises:
        ValueError: a gradient is sparse.
    """
    reducer = StageReducer(ddp)
    for s in range(len(reducer.stages()[0])):
        reducer(s)
    reducer.finish()


def _unique(params: Iterator[nn.Parameter]) -> list[nn.Parameter]:
    out: dict[int, nn.Parameter] = {}
    for p in params:
        out.setdefault(id(p), p)
    return list(out.values())


def _by_layout(params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` grouped by device and dtype, groups in first-seen order (a
    graphed stage's buffers are laid out so)."""
    groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault((p.device, p.dtype), []).append(p)
    return list(groups.values())


def _store_flats(
    store: GradStore | None, layout: Sequence[Sequence[nn.Parameter]]
) -> list[Tensor] | None:
    """The store's flat buffers, if they hold exactly the gradients of
    ``layout``'s groups, in order (else None: they are copied)."""
    if store is None:
        return None
    owned = [p for ps in _by_layout([p for p, _ in store.owned()]) for p in ps]
    if [id(p) for p in owned] != [id(p) for ps in layout for p in ps]:
        return None
    if len(store.flats) != len(layout):
        return None
    return list(store.flats)


def _laid_out(params: Sequence[nn.Parameter]) -> tuple[Tensor, list[Tensor]]:
    """One flat tensor for ``params``' gradients and a view per parameter,
    laid out as a graphed stage's buffers are (each as autograd lays out
    its gradient, one after another), so that every process reduces the
    same elements together whichever way its stage keeps them."""
    p0 = params[0]
    flat = torch.empty(sum(p.numel() for p in params), dtype=p0.dtype, device=p0.device)
    views, offset = [], 0
    for p in params:
        strides = torch.empty_like(p, device="meta").stride()
        views.append(flat.as_strided(p.shape, strides, offset))
        offset += p.numel()
    return flat, views

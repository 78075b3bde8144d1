"""Averaging a pipeline's gradients over DDP's process group, stage by stage.

A stage's gradients are final once its last backward (or weight) task of a
step has run: :class:`StageReducer` is called there, inside that task on the
stage's stream, and issues the stage's all-reduces, so they run while the
earlier stages still compute their backward (as DDP overlaps its buckets
with autograd). :meth:`StageReducer.finish` waits for them after the step
and divides by the group's size.

Every process must issue the same collectives in the same order, whatever
its schedule or micro-batch count made of its step (``schedule='auto'``
chooses per process; zero-bubble schedules end their stages in an order
that depends on the micro-batches): stages are issued from the last to the
first, a stage that ends before a later one waiting for it (on its own
stream, so its reduction still follows its work), then the parameters two
stages share (tied) or no stage holds, then one all-reduce of which
parameters had a gradient, so that one with a gradient on some processes
gets the average with zeros and one with a gradient nowhere keeps
``grad=None`` (DDP's ``find_unused_parameters`` rule). A stage's gradients
go as one flat tensor per device and dtype (its parameters in order), in
chunks of DDP's bucket size, whichever way the stage keeps them: a graphed
stage's gradient buffers (``Pipe(graphs=True)``) are that tensor already
and are reduced in place; other gradients are copied into one laid out the
same way, and back after. A step that fails completes the sequence with
zeros (:meth:`StageReducer.abort`), so that a process that failed elsewhere
in its step, or not at all, is not left waiting or paired with the next
step's collectives.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ..pipe.pipe import Pipe
from ..runtime.graphed import generation
from ..runtime.graphed.grads import GradStore
from ..runtime.stream import current_stream, record_stream

__all__ = ["StageReducer", "sync_gradients"]

# Bucket size for gradient collectives when DDP does not say (DDP's own default).
BUCKET_BYTES = 25 * 1024 * 1024


@dataclass
class _Group:
    """One unit's parameters of one device and dtype, reduced as one flat tensor."""

    params: list[nn.Parameter]
    flat: Tensor
    views: list[Tensor] | None  # where the gradients were copied from (None: the buffers)
    works: list[Any] = field(default_factory=list)


@dataclass
class _Units:
    """What a step reduces, in the order every process issues it: each stage's
    own parameters, last stage first, then the rest (tied, or in no stage)."""

    order: list[int]  # stage indices, then -1 for the rest
    params: dict[int, list[nn.Parameter]]
    names: dict[int, str]


class StageReducer:
    """Averages each stage's gradients over ``ddp``'s group as the stage ends.

    Call it with a stage's index inside that stage's last gradient task of a
    step, then :meth:`finish` after the step; :meth:`abort` instead, before
    anything is put back, if the step failed.

    Args:
        ddp: the DistributedDataParallel module around the pipe; every
            process of its group must run the same steps.

    Raises:
        ValueError: a gradient is sparse (when its stage's turn comes).
    """

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.pipe: Pipe = ddp.module
        self.group = ddp.process_group
        self.size = dist.get_world_size(self.group)
        self.cap = int(getattr(ddp, "bucket_bytes_cap", BUCKET_BYTES))
        self.ignored = frozenset(ddp.parameters_to_ignore)
        self.issued: list[tuple[list[_Group], GradStore | None]] = []
        self.ended: dict[int, Any] = {}  # unit -> the stream current when it ended
        self.next = 0  # position in the units' order of the next to issue
        self._units: _Units | None = None

    def units(self) -> _Units:
        """The step's units (found at first use: a traced pipe is split by its
        first call; kept on the pipe until a module registers something)."""
        if self._units is None:
            key = (generation(), self.ignored)
            cached = self.pipe.__dict__.get("_reduce_units")
            if cached is None or cached[0] != key:
                cached = (key, _units_of(self.pipe, self.ignored))
                self.pipe.__dict__["_reduce_units"] = cached
            self._units = cached[1]
        return self._units

    def __call__(self, stage: int) -> None:
        """Stage ``stage`` ended: issues every unit whose turn has come."""
        if stage not in self.ended:
            device = self.pipe.devices[stage]
            self.ended[stage] = current_stream(device) if device.type == "cuda" else None
            self._drain()

    def _drain(self) -> None:
        units = self.units()
        while self.next < len(units.order) and units.order[self.next] in self.ended:
            unit = units.order[self.next]
            self._check(unit)  # refused before its turn is taken: abort() completes it
            self.next += 1
            stream = self.ended[unit]
            # On the stream current when it ended: after its work, whatever
            # later stage's task issues it now.
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                self._issue(unit)

    def _check(self, unit: int) -> None:
        units = self.units()
        for p in units.params[unit]:
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError(
                    f"gradient of {units.names.get(id(p), 'a parameter')} is sparse; mpstream "
                    f"reduces dense gradients"
                )

    def _issue(self, unit: int) -> None:
        params = self.units().params[unit]
        if not params:
            return
        store = self.pipe._grad_stores()[unit] if unit >= 0 else None
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
            # Listed before issuing: a failure part-way still waits for what began.
            self.issued.append((groups, store if flats is not None else None))
            for g in groups:
                self._reduce(g)

    def _reduce(self, g: _Group) -> None:
        step = max(1, self.cap // g.flat.element_size())
        for start in range(0, g.flat.numel(), step):
            chunk = g.flat[start : start + step]
            g.works.append(dist.all_reduce(chunk, group=self.group, async_op=True))

    def _presence(self, flags: Sequence[bool], device: torch.device) -> Tensor:
        present = torch.tensor(flags, dtype=torch.int32, device=device)
        dist.all_reduce(present, group=self.group)
        return present

    def finish(self) -> None:
        """After the step: the rest reduced, every all-reduce waited for (on
        the current stream) and averaged, then which parameters had a
        gradient anywhere (one more all-reduce), and the averages written back.

        Raises:
            ValueError: a gradient is sparse (the sequence is completed first).
        """
        units = self.units()
        try:
            for unit in units.order:  # every stage ended in a training step
                self.ended.setdefault(unit, None)
            self._drain()
        except BaseException:
            self.abort()
            raise
        issued, self.issued = self.issued, []
        params = [p for unit in units.order for p in units.params[unit]]
        if not params:
            return
        with torch.no_grad():
            for groups, _ in issued:
                for g in groups:
                    for w in g.works:
                        w.wait()
                    if g.views is not None:  # made on a stage's stream, read on this one
                        record_stream(g.flat, current_stream(g.flat.device))
                    g.flat.div_(self.size)
            present = self._presence([p.grad is not None for p in params], params[0].device)
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
        """After a failed step, before its gradients are put back: completes
        the step's sequence of collectives with zeros (what the other
        processes issue is matched, whether they failed elsewhere or not at
        all) and waits for every one, so nothing writes into the gradients
        afterwards. A collective that fails ends the completion (the group
        is broken then); the first such error is raised after the waits."""
        units = self.units()
        first: BaseException | None = None
        try:
            with torch.no_grad():
                while self.next < len(units.order):
                    params = units.params[units.order[self.next]]
                    self.next += 1
                    for ps in _by_layout(params):
                        zeros = torch.zeros(
                            sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device
                        )
                        g = _Group(ps, zeros, [])
                        self.issued.append(([g], None))
                        self._reduce(g)
                params = [p for unit in units.order for p in units.params[unit]]
                if params:
                    self._presence([False] * len(params), params[0].device)
        except Exception as exc:
            first = exc
        issued, self.issued = self.issued, []
        for groups, _ in issued:
            for g in groups:
                for w in g.works:
                    try:
                        w.wait()
                    except Exception as exc:
                        first = first or exc
        if first is not None:
            raise first


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
    for stage in range(len(reducer.pipe.devices)):
        reducer(stage)
    reducer.finish()


def _units_of(pipe: Pipe, ignored: frozenset[str]) -> _Units:
    """Each stage's own parameters (last stage first), then the rest."""
    named = list(pipe.named_parameters())
    synced = {id(p) for n, p in named if p.requires_grad and n not in ignored}
    per_stage = [_unique(part.parameters()) for part in pipe.partitions]
    seen: dict[int, int] = {}
    for params in per_stage:
        for p in params:
            seen[id(p)] = seen.get(id(p), 0) + 1
    # A tied parameter is final only once both its stages ended.
    own = {
        s: [p for p in ps if id(p) in synced and seen[id(p)] == 1] for s, ps in enumerate(per_stage)
    }
    staged = {id(p) for ps in own.values() for p in ps}
    own[-1] = _unique(p for _, p in named if id(p) in synced and id(p) not in staged)
    order = [*range(len(per_stage) - 1, -1, -1), -1]
    return _Units(order, own, {id(p): n for n, p in named})


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

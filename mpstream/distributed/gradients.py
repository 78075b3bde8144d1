"""Averaging a pipeline's gradients over DDP's process group, stage by stage.

A stage's gradients are final once its last backward (or weight) task of a
step has run: :class:`StageReducer` is called there, inside that task on the
stage's stream, and issues the stage's all-reduces, so they run while the
earlier stages still compute their backward (as DDP overlaps its buckets
with autograd). :meth:`StageReducer.end` waits for them after the step
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
same way (:func:`~mpstream.runtime.graphed.grad_buffers.lay_out`), and back after.
A step that fails completes the sequence with zeros
(:meth:`StageReducer.abort`) and says so in that last all-reduce, so that a
process that failed elsewhere in its step, or not at all, is neither left
waiting nor paired with the next step's collectives, and undoes its step
too (:meth:`StageReducer.end` raises there).
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
from ..runtime.graphed.grad_buffers import lay_out
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

    Called with a stage's index inside that stage's last gradient task of a
    step, :meth:`end` once every task ran (inside the step, so that a
    failure there is undone with it), :meth:`abort` instead if the step
    failed, before anything is put back. Every process ends the step the
    same way: if any process aborted, :meth:`end` raises on the others, so
    each one undoes the step.

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
        self.exchanged = False  # the presence all-reduce, which closes the sequence
        self._units: _Units | None = None

    def units(self) -> _Units:
        """The step's units, found at first use (a traced pipe is split by
        its first call) and kept on the pipe while its modules, split and
        parameters' ``requires_grad`` stay as they are."""
        if self._units is None:
            cached = self.pipe.__dict__.get("_reduce_units")
            if cached is None or cached[0] != (generation(), self.ignored, self._split()):
                cached = None
            else:
                flags = [p.requires_grad for p in cached[2]]
                cached = cached if flags == cached[3] else None
            if cached is None:
                units = _units_of(self.pipe, self.ignored)
                candidates = [p for _, p in self.pipe.named_parameters()]
                key = (generation(), self.ignored, self._split())
                cached = (key, units, candidates, [p.requires_grad for p in candidates])
                self.pipe.__dict__["_reduce_units"] = cached
            self._units = cached[1]
        return self._units

    def _split(self) -> int:
        # A traced pipe switches between splits it keeps, registering nothing.
        return id(self.pipe.__dict__.get("_partitions"))

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
            stream = self.ended[unit]
            # On the stream current when it ended: after its work, whatever
            # later stage's task issues it now.
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                # Built before its turn is taken: a refusal (a sparse
                # gradient) or an allocation failure leaves it to abort().
                groups, store = self._prepare(unit)
                self.next += 1
                self.issued.append((groups, store))
                for g in groups:
                    self._reduce(g)

    def _prepare(self, unit: int) -> tuple[list[_Group], GradStore | None]:
        """The unit's flat tensors: a graphed stage's buffers, or copies laid out alike."""
        units = self.units()
        params = units.params[unit]
        for p in params:
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError(
                    f"gradient of {units.names.get(id(p), 'a parameter')} is sparse; mpstream "
                    f"reduces dense gradients"
                )
        if not params:
            return [], None
        store = self.pipe._grad_stores()[unit] if unit >= 0 else None
        layout = _by_layout(params)
        flats = _store_flats(store, layout)
        with torch.no_grad():
            if flats is None:
                groups = []
                for ps in layout:
                    flat, views = lay_out(ps)
                    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps]
                    torch._foreach_copy_(views, grads)
                    groups.append(_Group(ps, flat, views))
                return groups, None
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
        return [_Group(ps, flat, None) for ps, flat in zip(layout, flats)], store

    def _chunks(self, numel: int, itemsize: int) -> Iterator[tuple[int, int]]:
        step = max(1, self.cap // itemsize)
        for start in range(0, numel, step):
            yield start, min(numel, start + step)

    def _reduce(self, g: _Group) -> None:
        for start, stop in self._chunks(g.flat.numel(), g.flat.element_size()):
            chunk = g.flat[start:stop]
            g.works.append(dist.all_reduce(chunk, group=self.group, async_op=True))

    def _exchange(self, aborted: bool) -> tuple[set[int], bool]:
        """Which parameters had a gradient on some process, and whether some
        process aborted: the sequence's last all-reduce."""
        units = self.units()
        params = [p for unit in units.order for p in units.params[unit]]
        flags = [p.grad is not None and not aborted for p in params] + [aborted]
        device = params[0].device if params else torch.device("cpu")
        present = torch.tensor(flags, dtype=torch.int32, device=device)
        self.exchanged = True
        dist.all_reduce(present, group=self.group)
        counts = present.tolist()
        return {id(p) for p, n in zip(params, counts) if n}, counts[-1] > 0

    def end(self) -> None:
        """Every task of the step ran: the rest reduced, every all-reduce
        waited for (on the current stream) and averaged, which parameters
        had a gradient anywhere exchanged, and the averages written back.

        Raises:
            RuntimeError: another process of the group aborted this step
                (nothing is written back; the caller undoes the step).
            ValueError: a gradient is sparse.
        """
        units = self.units()
        for unit in units.order:  # a stage with no gradient task ends here
            self.ended.setdefault(unit, None)
        self._drain()
        with torch.no_grad():
            for groups, _ in self.issued:
                for g in groups:
                    for w in g.works:
                        w.wait()
                    if g.views is not None:  # made on a stage's stream, read on this one
                        record_stream(g.flat, current_stream(g.flat.device))
        anywhere, aborted = self._exchange(aborted=False)
        if aborted:
            raise RuntimeError(
                "another process of the group failed this training step (its error is "
                "raised there); the step is undone here too, so the processes stay alike"
            )
        issued, self.issued = self.issued, []
        with torch.no_grad():
            for groups, store in issued:
                for g in groups:
                    g.flat.div_(self.size)
                    if g.views is None:
                        continue
                    for p, view in zip(g.params, g.views):
                        if id(p) in anywhere:
                            if p.grad is None:
                                p.grad = torch.zeros_like(p)
                            p.grad.copy_(view)
                if store is not None:  # a gradient from elsewhere: .grad is the view again
                    for p, v in store.owned():
                        if p.grad is not v and id(p) in anywhere:
                            p.grad = v

    def abort(self) -> None:
        """The step failed here (or :meth:`end` found another process's
        failure), before its gradients are put back: completes the step's
        sequence of collectives with zeros, so every other process's pairs
        up and learns of the failure, and waits for every one, so nothing
        writes into the gradients afterwards. Does nothing a second time.
        A collective that fails ends the completion (the group is broken
        then); the first such error is raised after the waits.
        """
        first: BaseException | None = None
        try:
            units = self.units()
            with torch.no_grad():
                while self.next < len(units.order):
                    params = units.params[units.order[self.next]]
                    self.next += 1
                    for ps in _by_layout(params):
                        self._zeros(ps)
                if not self.exchanged:
                    self._exchange(aborted=True)
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

    def _zeros(self, params: Sequence[nn.Parameter]) -> None:
        """All-reduces zeros in the chunks a group of ``params`` would take,
        one chunk-sized buffer at a time (a failed step may be out of memory)."""
        numel = sum(p.numel() for p in params)
        p0 = params[0]
        chunks = list(self._chunks(numel, p0.element_size()))
        buf = torch.empty(max(b - a for a, b in chunks), dtype=p0.dtype, device=p0.device)
        for start, stop in chunks:
            chunk = buf[: stop - start]
            chunk.zero_()
            dist.all_reduce(chunk, group=self.group)


def sync_gradients(ddp: DistributedDataParallel) -> None:
    """Averages the ``.grad`` of the wrapped module's parameters over ``ddp``'s group.

    Parameters that do not require grad, and those DDP was told to ignore,
    are left alone. A parameter with a gradient on some processes only gets
    the average of the others' with zeros (DDP's ``find_unused_parameters``
    rule); one without a gradient anywhere keeps ``grad=None``. Graphed
    stages' gradient buffers (``Pipe(graphs=True)``: the parameters'
    ``.grad`` are views of one flat buffer per stage and dtype) are reduced
    in place, in chunks of the bucket size; the other gradients are copied
    into one tensor per stage, device and dtype. All of the all-reduces are
    issued before the first is waited for. :func:`~mpstream.distributed.train_step`
    issues each stage's as the stage ends instead.

    Args:
        ddp: a DistributedDataParallel module; every process of its group
            must call this.

    Raises:
        ValueError: a gradient is sparse (on every process: the others
            learn of it through the sequence's last all-reduce).
        RuntimeError: another process's call failed.
    """
    reducer = StageReducer(ddp)
    try:
        for stage in range(len(reducer.pipe.devices)):
            reducer(stage)
        reducer.end()
    except BaseException:
        reducer.abort()
        raise


def _units_of(pipe: Pipe, ignored: frozenset[str]) -> _Units:
    """Each stage's own parameters (last stage first), then the rest."""
    named = list(pipe.named_parameters())
    synced = {id(p) for n, p in named if p.requires_grad and n not in ignored}
    per_stage = [list(part.parameters()) for part in pipe.partitions]  # each once
    seen: dict[int, int] = {}
    for params in per_stage:
        for p in params:
            seen[id(p)] = seen.get(id(p), 0) + 1
    # A tied parameter is final only once both its stages ended.
    own = {
        s: [p for p in ps if id(p) in synced and seen[id(p)] == 1] for s, ps in enumerate(per_stage)
    }
    staged = {id(p) for ps in own.values() for p in ps}
    own[-1] = [p for _, p in named if id(p) in synced and id(p) not in staged]
    order = [*range(len(per_stage) - 1, -1, -1), -1]
    return _Units(order, own, {id(p): n for n, p in named})


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
    return list(store.flats)  # one per group: the same grouping of the same parameters

"""Checks allocator protection on the CPU: every tensor a task reads on
another stream than the one that allocated it must have been marked for
that stream (``record_stream``) first.

On a GPU a missing mark is a silent race: the caching allocator hands the
memory out again once the allocating stream frees it, while another stream
may still read it. On the CPU there are no streams, so the check emulates
what the device would see, from what the scheduler logs:

- the stream an op runs on is the slot the open task runs on (the plan's
  ``run`` op of that task; on one device the issuing stream is the current
  one, as in ``Scheduler::begin``);
- a tensor an op returns on storage none of its inputs has is allocated on
  that stream;
- each stage's streams are distinct stand-ins, so the runtime's marks (which
  it makes only for CUDA streams) are made and logged with their slot;
- a read needs its mark by the end of the task that reads, or before its
  memory is handed out again if that comes first (the runtime's rule: a mark
  made after the read is issued, before the task lets go of the tensor,
  keeps the memory from the allocator as well).

Tensors allocated outside the run's tasks (the caller's inputs, parameters,
pinned staging) are held by the caller until the run joined its streams, so
they need no mark. Only eager stages are checked: a graphed stage's buffers
are held by its slots, not marked.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mpstream.runtime import boundary, copy, executor, forward, losses, runs, training, values
from mpstream.runtime.scheduler import EventScheduler
from mpstream.runtime.stream import CPUStream

__all__ = ["Uses", "checking_uses"]


class SlotStream(CPUStream):
    """A stage stream stand-in that knows its slot."""

    def __init__(self, slot: int) -> None:
        self.slot = slot

    def __repr__(self) -> str:
        return f"SlotStream({self.slot})"


def _key(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


@dataclass
class Uses:
    """What the check saw; ``missing`` lists the unmarked cross-stream reads."""

    sched: EventScheduler
    slot: int | None = None  # the open task's, None outside tasks
    task: str = ""
    allocated: dict[int, int] = field(default_factory=dict)  # storage -> slot
    marked: dict[int, set[int]] = field(default_factory=dict)  # storage -> slots
    missing: list[str] = field(default_factory=list)
    reads: int = 0  # cross-stream reads checked
    pending: dict[int, str] = field(default_factory=dict)  # the open task's reads

    def close(self) -> None:
        """The open task ends: each of its cross-stream reads must be marked."""
        for k in list(self.pending):
            self._settle(k)
        self.slot = None

    def mark(self, t: torch.Tensor, stream: Any) -> None:
        if isinstance(stream, SlotStream) and t.numel():
            self.marked.setdefault(_key(t), set()).add(stream.slot)

    def op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if self.slot is None:
            return
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        seen = set()
        for t in inputs:
            if not t.numel():
                continue
            k = _key(t)
            seen.add(k)
            home = self.allocated.get(k)
            if home is None or home == self.slot:
                continue
            self.reads += 1
            if k not in self.pending:
                self.pending[k] = (
                    f"{self.task} ran {func} on slot {self.slot} "
                    f"({self.sched.slot_names[self.slot]}) over a {tuple(t.shape)} tensor "
                    f"allocated on slot {home} ({self.sched.slot_names[home]}) without a mark"
                )
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel():
                k = _key(t)
                if k not in seen:  # new storage: allocated here
                    # Its address was freed and handed out again: a read of
                    # what lived there is settled by the marks it had.
                    self._settle(k)
                    self.allocated[k] = self.slot
                    self.marked.pop(k, None)

    def _settle(self, k: int) -> None:
        what = self.pending.pop(k, None)
        if what is not None and self.slot not in self.marked.get(k, ()):
            self.missing.append(what)


class _Mode(TorchDispatchMode):
    def __init__(self, uses: Uses) -> None:
        super().__init__()
        self.uses = uses

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.uses.op(func, args, kwargs or {}, out)
        return out


@contextmanager
def checking_uses(sched: EventScheduler) -> Iterator[Uses]:
    """Runs of ``sched``'s pipe inside are checked (CPU stages only)."""
    assert not sched.virtual and all(d.type == "cpu" for d in sched.devices)
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield from _checking(sched, monkeypatch)


def _checking(sched: EventScheduler, monkeypatch: pytest.MonkeyPatch) -> Iterator[Uses]:
    uses = Uses(sched)
    n = len(sched.devices)
    monkeypatch.setattr(sched, "compute_streams", [SlotStream(2 * s) for s in range(n)])
    monkeypatch.setattr(sched, "copy_streams", [SlotStream(2 * s + 1) for s in range(n)])

    def keep(streams: Any) -> list[Any]:
        return [s if isinstance(s, SlotStream) else None for s in streams]

    for module in (values, runs, forward, training):
        monkeypatch.setattr(module, "cuda_only", keep)
    for module in (values, copy, boundary, losses):
        monkeypatch.setattr(module, "record_stream", uses.mark)
    real = executor.execute

    def execute(worker: Any, schedule: Any, state: Any, *args: Any, **kwargs: Any) -> None:
        def wrap(handler: executor.Handler) -> executor.Handler:
            def run(r: Any, task: Any) -> None:
                ops = sched.plan()
                sched.clear_plan()
                runs = [op for op in ops if op.op == "run" and op.task == task.index]
                assert runs, f"no run op logged for {task}"
                uses.slot, uses.task = runs[-1].slot, repr(task)
                try:
                    handler(r, task)
                finally:
                    uses.close()

            return run

        # The run's own table, shadowed for this run alone.
        state.handlers = {k: wrap(h) for k, h in state.handlers.items()}
        real(worker, schedule, state, *args, **kwargs)

    for module in (forward, training):
        monkeypatch.setattr(module, "execute", execute)
    sched.recording = True
    try:
        with _Mode(uses):
            yield uses
    finally:
        sched.recording = False
        sched.clear_plan()

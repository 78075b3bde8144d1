"""A pure-Python event scheduler, the baseline of the ``overhead`` group.

It issues the same plan as mpstream's C++ scheduler for a schedule (wait on
the source event once per stage stream, wait on each cross-stream
dependency, make the task's stream current, record its completion event from
a per-device pool), with ``torch.cuda.Event`` on GPUs. ``torch.Event`` has no
CPU backend, so on the CPU the events are no-op placeholders and only the
Python bookkeeping is measured, as the C++ scheduler does on CPU stages.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from mpstream.schedules.schedule import Kind, Schedule


class _NoEvent:
    def record(self, stream: object = None) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass


class PyEventScheduler:
    """Per-task issue in Python: the comparison point for ``mpstream._C``."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        cuda = [d.type == "cuda" for d in self.devices]
        self.compute = [torch.cuda.Stream(d) if c else None for d, c in zip(self.devices, cuda)]
        self.copy = [torch.cuda.Stream(d) if c else None for d, c in zip(self.devices, cuda)]
        self.io = {
            d: torch.cuda.Stream(d) if d.type == "cuda" else None for d in dict.fromkeys(devices)
        }
        self._free: dict[torch.device, list[object]] = defaultdict(list)

    def _event(self, device: torch.device) -> object:
        free = self._free[device]
        if free:
            return free.pop()
        return torch.cuda.Event() if device.type == "cuda" else _NoEvent()

    def _slots(self, kind: Kind, stage: int) -> tuple[object, int, object, int]:
        if kind in (Kind.FORWARD, Kind.BACKWARD):
            return self.compute[stage], stage, self.compute[stage], stage
        if kind is Kind.COPY and stage < 0:
            return None, -1, self.io[self.devices[0]], 0
        if kind is Kind.TARGET:
            return None, -1, self.io[self.devices[stage]], stage
        if kind is Kind.COPY:
            return self.copy[stage], stage, self.copy[stage + 1], stage + 1
        return self.copy[stage + 1], stage + 1, self.copy[stage], stage

    def run(self, schedule: Schedule) -> None:
        """Issues every task of ``schedule`` with nothing to compute."""
        sources = {}
        for d in dict.fromkeys(self.devices):
            ev = self._event(d)
            if d.type == "cuda":
                ev.record(torch.cuda.current_stream(d))  # type: ignore[call-arg]
            sources[d] = ev
        done: dict[int, tuple[object, torch.device]] = {}
        waited_source: set[int] = set()
        for task in schedule.tasks:
            issue, _, rec, rec_stage = self._slots(task.kind, task.stage)
            at = issue if issue is not None else rec
            for d in task.deps:
                ev, _ = done[d]
                ev.wait(at)  # type: ignore[attr-defined]
            if task.kind in (Kind.FORWARD, Kind.BACKWARD) and task.stage not in waited_source:
                sources[self.devices[task.stage]].wait(at)  # type: ignore[attr-defined]
                waited_source.add(task.stage)
            previous = []
            for s in (issue, rec):
                if s is not None:
                    previous.append(torch.cuda.current_stream(s.device))
                    torch.cuda.set_stream(s)
            device = self.devices[rec_stage]
            ev = self._event(device)
            ev.record(rec)  # type: ignore[attr-defined]
            done[task.index] = (ev, device)
            for p in reversed(previous):
                torch.cuda.set_stream(p)
        for d, ev in sources.items():
            self._free[d].append(ev)
        for ev, device in done.values():
            self._free[device].append(ev)

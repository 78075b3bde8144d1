"""What a pipe split once per kind of call does on every call: switch splits.

A traced module is split again for a call its current split cannot run:
``torch.fx`` (:mod:`~mpstream.stages.traced`) follows ``forward``'s Python
code, so a split holds for one set of None arguments and one set of
training flags; ``torch.export`` (:mod:`~mpstream.stages.exported`) also
fixes shapes and plain values. Each split keeps its own stages, stage graph
and pipe runtime. :class:`Kinds` is the switch both share:
:meth:`Kinds.enter` makes a split the pipe's current one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import fx, nn

from ..runtime.graph import StageGraph
from ..runtime.microbatch import gather
from ..schedules.schedule import check_schedule
from .placement import rebind

__all__ = ["Kind", "Kinds"]


class Kind(Protocol):
    """One kind of call's split, as the pipe uses it."""

    runtime: Any  # the pipe runtime, kept while another split is current
    checked: bool  # whether the pipe's schedule was checked against it

    @property
    def graph(self) -> StageGraph: ...

    @property
    def partitions(self) -> Sequence[fx.GraphModule]: ...

    @property
    def modules(self) -> nn.ModuleList: ...

    @property
    def balance(self) -> list[int]: ...


class Kinds:
    """The splits of one module, one per kind of call met so far.

    Subclasses set ``module`` (the split module), ``devices`` (one per
    stage) and ``current`` (the split the pipe runs now).
    """

    module: nn.Module
    devices: list[torch.device]
    current: Any

    def enter(
        self,
        split: Kind,
        schedule: Any,
        virtual_stages: int | None,
        training: bool,
        outgoing: Any,
    ) -> None:
        """Makes ``split`` the current one: its schedule checked (once), its
        stages reading the module's tensors, in the pipe's mode.

        Args:
            split: the split the call's kind needs.
            schedule: the pipe's schedule, checked against the split's graph.
            virtual_stages: the pipe's ``virtual_stages``.
            training: the pipe's mode.
            outgoing: the pipe runtime of the split it replaces, kept with
                that split for when its kind of call comes again.

        Raises:
            ValueError: the schedule does not fit the split's stage graph.
        """
        if self.current is not None:
            self.current.runtime = outgoing
        if not split.checked:
            check_schedule(schedule, self.devices, split.graph.reads(), virtual_stages)
            split.checked = True
        for part in split.partitions:
            rebind(part, self.module)
        split.modules.train(training)
        self.current = split

    def gather(self, outputs: Sequence[Any]) -> Any:
        """The micro-batches' outputs joined along dim 0."""
        return gather(outputs)

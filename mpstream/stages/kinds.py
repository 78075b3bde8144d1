"""What a pipe split once per kind of call does on every call: switch splits.

A traced module is split again for a call its current split cannot run:
``torch.fx`` (:mod:`~mpstream.stages.traced`) follows ``forward``'s Python
code, so a split holds for one set of None arguments and one set of
training flags; ``torch.export`` (:mod:`~mpstream.stages.exported`) also
fixes shapes and plain values. Each :class:`Split` keeps its own stages,
stage graph and pipe runtime (the pipe's streams and scheduler are shared by
all). :class:`Kinds` is the switch both tracers share: :meth:`Kinds.enter`
makes a split the pipe's current one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import fx, nn

from ..runtime.gathering import gather
from ..runtime.graph import StageGraph
from ..runtime.graphed import generation
from ..schedules.schedule import check_schedule
from .placement import rebind
from .shared_inputs import NO_CHANGES, ChangedInputs

__all__ = ["Split", "Kinds", "operations"]


def operations(partitions: Sequence[fx.GraphModule]) -> list[int]:
    """Traced operations per stage: a traced split's ``balance``."""
    return [sum(n.op.startswith("call") for n in p.graph.nodes) for p in partitions]


@dataclass(kw_only=True)
class Split:
    """One kind of call's split, as the pipe runs it.

    Attributes:
        modules: one ``GraphModule`` per stage.
        balance: traced operations per stage.
        graph: where each stage's arguments come from.
        described: one line for :meth:`mpstream.Pipe.split_report`.
        runtime: the pipe runtime, kept while another split is current.
        checked: whether the pipe's schedule was checked against the graph.
        changed: the inputs its forward changes in place.
        entered: the modules its trace entered, whose hooks are refused
            at each call it serves (see :mod:`~mpstream.stages.module_hooks`);
            None: not known (a split pickled by an earlier mpstream).
    """

    modules: nn.ModuleList
    balance: list[int]
    graph: StageGraph
    described: str
    runtime: Any = None
    checked: bool = False
    changed: ChangedInputs = NO_CHANGES
    entered: tuple[nn.Module, ...] | None = None

    @property
    def partitions(self) -> list[fx.GraphModule]:
        return [cast(fx.GraphModule, m) for m in self.modules]

    def __getstate__(self) -> dict[str, Any]:
        # Pickled or copied with its pipe, whose runtime (streams, C++
        # scheduler) is rebuilt on first use.
        state = dict(self.__dict__)
        state["runtime"] = None
        return state


class Kinds:
    """The splits of one module, one per kind of call met so far.

    Subclasses set ``module`` (the split module), ``devices`` (one per
    stage) and ``current`` (the split the pipe runs now).
    """

    module: nn.Module
    devices: list[torch.device]
    current: Split | None

    def enter(
        self,
        split: Split,
        schedule: Any,
        virtual_stages: int | None,
        training: bool,
        outgoing: Any,
    ) -> None:
        """Makes ``split`` the current one: its schedule checked (once), its
        stages reading the module's tensors, its stage wrappers in the
        pipe's mode (the module's own submodules keep their flags).

        Args:
            split: the split the call's kind needs.
            schedule: the pipe's schedule (as ``Pipe(schedule=...)`` takes
                it), checked against the split's graph.
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
            # The wrapper only: the module's own submodules it calls keep the
            # flags they have (a frozen BatchNorm, dropout kept on in eval).
            part.training = training
        self.current = split
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        """Points the current split's stages at the module's tensors again
        when any module registered a tensor since they last were.

        A stage holds each tensor it reads outside a called layer itself (a
        torch.fx stage's ``F.linear(x, self.b.weight)``, every tensor of an
        exported stage): ``pipe.b.weight = nn.Parameter(...)`` replaces it
        in the layer alone, and the stage would go on reading the old one.
        """
        now = generation()
        if force or self.__dict__.get("_bound") != now:
            assert self.current is not None
            for part in self.current.partitions:
                rebind(part, self.module)
            self.__dict__["_bound"] = now

    def __getstate__(self) -> dict[str, Any]:
        # The registration counter is this process's: a copy or a loaded
        # pipe binds again on its first call.
        state = dict(self.__dict__)
        state.pop("_bound", None)
        state.pop("_forwards", None)  # instance forwards seen: this process's objects
        return state

    def gather(self, outputs: Sequence[Any]) -> Any:
        """The micro-batches' outputs joined (see
        :func:`~mpstream.runtime.gathering.gather`)."""
        return gather(outputs)

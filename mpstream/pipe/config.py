"""What a Pipe is configured with, and what runs it.

:class:`PipeConfig` sits between :class:`~mpstream.pipe.module.PipeModule`
(the ``nn.Module`` side) and :class:`~mpstream.pipe.call.PipeCall` (a call;
then :class:`~mpstream.Pipe`, a training step): the stages' devices,
balance and split points, the micro-batch size, and the runtime built on
first use (:class:`Runtime`: the worker, with the event scheduler, stage
streams and graphed stages, and the cached schedule of each kind of run).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..memory.batchnorm import DeferredBatchNorm, deferred_norms
from ..memory.checkpoint import check_mode, checkpoint_stop
from ..memory.shared_writes import SharedWrites
from ..runtime.errors import stage_labels
from ..runtime.graph import StageGraph
from ..runtime.graphed import GradStore, GraphReport, StageGraphs, generation
from ..runtime.scheduler import EventScheduler
from ..runtime.worker import Worker
from ..schedules.auto import Auto, ScheduleReport
from ..schedules.placement import check_virtual_stages
from ..schedules.schedule import (
    PipeSchedule,
    Schedule,
    schedule_arg,
)
from ..stages.buffer_uses import buffer_uses
from ..stages.sequential import check_flag, check_positive
from ..stages.tracers import SplitReport
from .auto import Choices
from .compiling import compile_stages
from .module import PipeModule, unsplit
from .run_schedule import run_schedule, step_schedule

__all__ = ["PipeConfig", "Runtime"]


class Runtime(NamedTuple):
    """What a pipe runs on, built on first use: the worker (its event
    scheduler and stage streams are ``worker.sched``), and the cached
    schedule of each kind of run."""

    worker: Worker
    schedules: dict[tuple[Any, ...], Schedule]


class PipeConfig(PipeModule):
    """Base of :class:`~mpstream.Pipe`: its configuration and runtime.

    Expects, besides what :class:`~mpstream.pipe.module.PipeModule` does,
    ``_devices``, ``_balance``, ``_graph``, ``_split_points``, ``_split``,
    ``_report``, ``_compile`` and ``_graphed`` in ``__dict__``, and the
    attributes ``_chunks``, ``_split_size``, ``_virtual_stages`` and
    ``_force_copies``.
    """

    _chunks: int | None
    _split_size: int | None

    @property
    def devices(self) -> list[torch.device]:
        """The device of each stage."""
        return list(self.__dict__["_devices"])

    @property
    def balance(self) -> list[int]:
        """Layers per stage (traced operations per stage for a traced module).

        Raises:
            RuntimeError: the pipe is not split yet (call it once first).
        """
        if self.__dict__["_balance"] is None:
            raise unsplit("pipe.balance")
        return list(self.__dict__["_balance"])

    @property
    def split_points(self) -> list[str] | None:
        """Where the stages of a traced module begin (given, or picked by
        ``balance='time'|'size'``); None for a Sequential."""
        points = self.__dict__["_split_points"]
        return None if points is None else list(points)

    def split_report(self) -> SplitReport:
        """Which tracer split the module into stages and why.

        Returns:
            The report: the tracer and why, the split points and, for
            ``torch.export``, each kind of call exported so far and how the
            model's own loss is combined over micro-batches (``str()`` of
            it reads as text).
        """
        split = self.__dict__["_split"]
        return split.report() if split is not None else self.__dict__["_report"]  # type: ignore[no-any-return]

    @property
    def chunks(self) -> int | None:
        """Number of micro-batches, or None when ``split_size`` is set."""
        return self._chunks

    @chunks.setter
    def chunks(self, value: int | None) -> None:
        self._chunks = None if value is None else check_positive("chunks", value)
        if value is not None:
            self._split_size = None

    @property
    def split_size(self) -> int | None:
        """Micro-batch size, or None when ``chunks`` is set."""
        return self._split_size

    @split_size.setter
    def split_size(self, value: int | None) -> None:
        self._split_size = None if value is None else check_positive("split_size", value)
        if value is not None:
            self._chunks = None

    @property
    def checkpoint(self) -> str:
        """Which micro-batches' stages are checkpointed: ``'always'``,
        ``'except_last'`` or ``'never'`` (checked when set)."""
        return self.__dict__["_checkpoint"]  # type: ignore[no-any-return]

    @checkpoint.setter
    def checkpoint(self, mode: str) -> None:
        self.__dict__["_checkpoint"] = check_mode(mode)

    @property
    def schedule(self) -> str | tuple[str, ...] | Auto:
        """The schedule: a built-in's name, an explicit order as a tuple of
        actions (parsed when set; checked against the stages, with
        ``virtual_stages``, at the next call), or ``'auto'`` (an
        :class:`~mpstream.schedules.auto.Auto` as given), chosen at the
        next ``train_step`` of each micro-batch size (:meth:`schedule_report`
        says what it chose for the latest)."""
        return self.__dict__["_schedule"]  # type: ignore[no-any-return]

    @schedule.setter
    def schedule(self, value: PipeSchedule) -> None:
        self.__dict__["_schedule"] = schedule_arg(value)
        self._forget_choices()

    @property
    def virtual_stages(self) -> int | None:
        """Stages per pipeline rank for the schedules that place several on
        one, or None to infer them from the devices (a positive int,
        checked when set; against the stages at the next call); setting it
        makes ``schedule='auto'`` choose again, among the schedules it now
        fits."""
        return self.__dict__["_virtual_stages"]  # type: ignore[no-any-return]

    @virtual_stages.setter
    def virtual_stages(self, value: int | None) -> None:
        self.__dict__["_virtual_stages"] = None if value is None else check_virtual_stages(value)
        self._forget_choices()  # chosen among what the old value fitted

    @property
    def force_copies(self) -> bool:
        """Whether every micro-batch is copied between consecutive stages on
        one device too (see ``Pipe``); a bool, checked when set (a string
        such as ``"false"`` would read as true)."""
        return self.__dict__["_force_copies"]  # type: ignore[no-any-return]

    @force_copies.setter
    def force_copies(self, value: bool) -> None:
        self.__dict__["_force_copies"] = check_flag("force_copies", value)

    def _forget_choices(self) -> None:
        """Makes ``schedule='auto'`` choose again at the next step of each size."""
        self.__dict__["_auto_choices"] = Choices()

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_auto_reports" in state:  # pickled before Choices held what 'auto' chose
            choices = state["_auto_choices"] = Choices()
            choices.by_sizes.update(state.pop("_auto_reports") or {})
            choices.latest = state.pop("_auto_report", None)
        super().__setstate__(state)

    def _choices(self) -> Choices:
        """What ``schedule='auto'`` chose (:class:`~mpstream.pipe.auto.Choices`)."""
        found = self.__dict__.get("_auto_choices")
        if found is None:
            found = self.__dict__["_auto_choices"] = Choices()
        return found  # type: ignore[no-any-return]

    def schedule_report(self) -> ScheduleReport:
        """What ``schedule='auto'`` chose and why: each fitting schedule's
        simulated step and peak activation memory per device, and the costs
        simulated.

        Returns:
            The report of the choice (``str()`` of it reads as a table).

        Raises:
            ValueError: the schedule is not ``'auto'``.
            RuntimeError: it has not chosen yet (it does at the first
                ``train_step``).
        """
        return self._choices().report(self.schedule)

    @property
    def scheduler(self) -> EventScheduler:
        """The event scheduler and stage streams (created on first use; one
        per device list, so it exists before a first-call split too)."""
        # One scheduler (streams, timing, plan recording) for the runtime of
        # every kind of call a traced module is split for.
        sched = self.__dict__.get("_scheduler")
        if sched is None:
            sched = self.__dict__["_scheduler"] = EventScheduler(self.devices)
        return sched  # type: ignore[no-any-return]

    def _rt(self) -> Runtime:
        rt = self.__dict__["_runtime"]
        if rt is None:
            sched = self.scheduler
            stages = compile_stages(list(self.partitions), self.__dict__["_compile"])
            labels = self._labels()
            graphed = self.__dict__["_graphed"]
            backend = None if graphed is True else graphed
            graphs = StageGraphs(stages, self.devices, labels, backend) if graphed else None
            worker = Worker(stages, sched, self.graph, labels, graphs)
            rt = self.__dict__["_runtime"] = Runtime(worker, {})
        return rt  # type: ignore[no-any-return]

    def _labels(self) -> list[str]:
        """How error notes name each stage: its layers (or split point) and device."""
        points = self.__dict__["_split_points"]
        if points is None:
            return stage_labels(list(self._modules), self.balance, self.devices)
        n = len(self.devices)
        starts = ["the start", *[f"'{p}'" for p in points]]
        return [f"stage {s} of {n} (from {starts[s]} on {d})" for s, d in enumerate(self.devices)]

    def _grad_stores(self) -> list[GradStore | None]:
        """Per stage, the gradient buffers its graphs add into (None where
        it has none: eager, or not captured yet)."""
        graphs = self._rt().worker.graphs
        return graphs.stores() if graphs is not None else [None] * len(self.devices)

    @property
    def graphed(self) -> bool:
        """Whether the stages replay CUDA graphs (``Pipe(graphs=...)``)."""
        return self.__dict__["_graphed"] is not None

    def graph_report(self) -> GraphReport:
        """Which stages and passes replay CUDA graphs, how many graphs exist
        and the memory their capture reserved (``Pipe(graphs=True)``).

        Returns:
            The report (``str()`` of it reads as text).

        Raises:
            ValueError: the pipe was built without ``graphs=True``.
            RuntimeError: the pipe is not split yet (call it once first).
        """
        if not self.graphed:
            raise ValueError("this pipe replays no graphs: build it with Pipe(..., graphs=True)")
        if self.__dict__["_graph"] is None:
            raise unsplit("pipe.graph_report()")
        graphs = self._rt().worker.graphs
        assert graphs is not None
        return graphs.report()

    @property
    def graph(self) -> StageGraph:
        """Where each stage's arguments come from (a chain for a Sequential).

        Raises:
            RuntimeError: the pipe is not split yet (call it once first).
        """
        graph = self.__dict__["_graph"]
        if graph is None:
            raise unsplit("pipe.graph")
        return graph  # type: ignore[no-any-return]

    def schedule_for(
        self,
        micros: int,
        input_device: torch.device | str,
        *,
        training_step: bool = False,
        target_device: torch.device | str | None = None,
    ) -> Schedule:
        """The (cached) schedule for ``micros`` micro-batches.

        Forward-only runs are fill-drain; a training step uses
        :attr:`schedule` with backward tasks, and a transfer task per
        micro-batch when the targets sit on ``target_device``, not on the
        last stage's device.

        Args:
            micros: the micro-batch count of the run.
            input_device: where the batch sits (a ``torch.device`` or its
                name): off the first stage's device, each micro-batch gets a
                transfer task.
            training_step: the schedule of :meth:`train_step` (forwards and
                backwards in :attr:`schedule`'s order) rather than of
                ``pipe(x)``.
            target_device: where ``train_step``'s target sits (a device or
                its name).

        Returns:
            The schedule; ``str()`` of a training step's is its order of
            actions (``'F0m0 F1m0 ...'``), which ``schedule=`` takes back.

        Raises:
            RuntimeError: the pipe is not split yet (call it once first), or
                ``schedule='auto'`` has not chosen yet (at the first
                ``train_step``).
            ValueError: the schedule does not fit the stages' placement
                (set ``virtual_stages`` or another schedule).
        """
        graph = self.__dict__["_graph"]
        if graph is None:
            raise unsplit("pipe.schedule_for()")
        devs = self.__dict__["_devices"]
        chosen = None  # a forward-only run's: fill-drain
        if training_step:
            chosen = step_schedule(self.schedule, self._choices(), devs, self.virtual_stages)
        return run_schedule(
            self._rt().schedules,
            devs,
            graph,  # read above: no property call per run
            chosen,
            micros,
            input_device,
            target_device,
            self.force_copies,
        )

    def _deferred_norms(self) -> list[DeferredBatchNorm]:
        """The deferred BatchNorm layers, found again only after one was made
        (every call updates them; a walk over all modules per call costs)."""
        found = self.__dict__.get("_deferred")
        if found is None or found[0] != DeferredBatchNorm.created:
            found = (DeferredBatchNorm.created, deferred_norms(self))
            self.__dict__["_deferred"] = found
        return found[1]  # type: ignore[no-any-return]

    def _prepare(self, micros: int) -> int:
        """Per-run setup; returns how many micro-batches to checkpoint.

        Raises:
            ValueError: one stage would write a buffer (a norm's statistics)
                that another uses at once (:mod:`~mpstream.memory.shared_writes`).
        """
        parts = self.__dict__["_partitions"]
        found = self.__dict__.get("_shared_writes")
        now = (generation(), id(parts))
        if found is None or found[0] != now:  # a walk over every module costs
            uses = buffer_uses(parts, self.__dict__["_graph"])
            found = (now, SharedWrites(self, parts, uses))
            self.__dict__["_shared_writes"] = found
        found[1].check(self._labels)
        training = self.training and torch.is_grad_enabled()
        return checkpoint_stop(self.checkpoint, micros, training)

    def _finish(self) -> None:
        """Ends what :meth:`_prepare` began, whether the run raised or not:
        the watch's hooks come off the modules it never called."""
        found = self.__dict__.get("_shared_writes")
        if found is not None:
            found[1].watch.disarm()

"""``mpstream.Pipe``: a module pipelined over devices and streams.

Its construction and its training step; a call, ``pipe(x)``, is
:class:`~mpstream.pipe.call.PipeCall`'s, which it extends.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from ..memory.batchnorm import converted
from ..runtime.errors import annotate
from ..runtime.graphed import Backend, generation
from ..runtime.microbatch import Value, batch_device, scatter
from ..runtime.stream import capturing
from ..runtime.training import run as run_step
from ..schedules.schedule import PipeSchedule, check_schedule
from ..stages.build import build, check_module
from ..stages.exported import own_loss
from ..stages.sequential import DeviceLike, check_positive
from .call import PipeCall
from .compiling import CompileOption, compile_options
from .inputs import detached, keywords_of, micro_sizes
from .reduction import step_reduction
from .snapshot import Norms, Snapshot

__all__ = ["Pipe"]


class Pipe(PipeCall):
    """Pipeline-parallel wrapper running each stage on its own CUDA stream.

    The batch is split into micro-batches along dim 0. Stage ``s`` computes
    every micro-batch on a dedicated compute stream; its output moves to the
    next stage's device on dedicated copy streams; CUDA events from mpstream's
    C++ scheduler order all of it, so the copy of one micro-batch overlaps the
    compute of the next. Backward runs through autograd on the same streams.
    On CPU the streams are placeholders and the results are the same.

    Args:
        module: an ``nn.Sequential``, or with ``split_points`` any module
            ``torch.fx`` can trace or ``torch.export`` can export (a
            Hugging Face transformers model, say). A Sequential without
            ``balance``/``devices`` has one stage per child, already placed.
        chunks: number of micro-batches (like ``torch.chunk``).
        split_size: micro-batch size (like ``torch.split``); give at most one
            of ``chunks`` and ``split_size``; neither means one micro-batch.
        balance: layers per stage; the module's children are partitioned
            and each partition moved to its entry of ``devices``. ``'time'``
            or ``'size'`` profiles the layers on ``sample`` and picks the
            split that minimises the slowest (or largest) stage; for a
            module that is not a Sequential it picks the split points among
            the calls of its children and of their ModuleList/Sequential
            items.
        devices: one device per stage (several stages may share a device).
        checkpoint: ``'never'`` (default), ``'except_last'`` or ``'always'``:
            which micro-batches keep only their stage inputs and recompute the
            rest during backward (on the stage's stream; never in eval mode).
        deferred_batch_norm: replace BatchNorm layers by
            :class:`~mpstream.memory.batchnorm.DeferredBatchNorm`, whose running
            statistics are updated once per mini-batch as the single-device
            model would.
        schedule: order of :meth:`train_step`: ``'gpipe'`` (fill-drain),
            ``'1f1b'`` (at most ``stages - s`` micro-batches in flight on
            stage ``s``), ``'zb_h1'`` (zero-bubble H1: each backward split
            into input and weight passes, weight passes filling the
            bubbles); with several stages per pipeline rank (see
            ``virtual_stages``) ``'interleaved_1f1b'`` (Megatron-LM's),
            ``'interleaved_zb'``, ``'looped_bfs'``, ``'zbv'`` and
            ``'dualpipev'`` (see ``docs/schedules.md``); ``'auto'`` (or an
            :class:`~mpstream.schedules.auto.Auto`) picks the built-in one
            with the shortest simulated step at the first ``train_step``
            (:meth:`schedule_report`); or an explicit order of actions
            (``['F0m0', 'F1m0', 'B1m0', 'B0m0']``, see
            :mod:`mpstream.schedules.orders`; ``str(pipe.schedule_for(...))``
            prints a built-in one to start from). ``pipe(x)`` always runs
            fill-drain.
        virtual_stages: stages per pipeline rank for the round-robin
            schedules (stage ``s`` on rank ``s mod (stages /
            virtual_stages)``), by default inferred from devices placed
            round-robin (``['cuda:0', 'cuda:1', 'cuda:0', 'cuda:1']``);
            2 for the V ones (stage ``s`` on rank ``min(s, stages - 1 -
            s)``), by default from devices placed in a V (``['cuda:0',
            'cuda:1', 'cuda:1', 'cuda:0']``). Needed when every stage
            shares one device (the CPU).
        sample: a representative micro-batch (an example call of a traced
            module: a tuple of positional arguments, a dict of keyword
            arguments, or the one input), for ``balance='time'|'size'``; a
            traced module is first split for its kind of call (its None
            arguments). ``torch.export`` needs an example call: without
            one it splits the module at the first call, on its arguments.
        force_copies: for experiments: copy every micro-batch between
            consecutive stages (and its gradient back) on the copy streams
            even when they share a device, as between two GPUs. With all
            stages on one GPU this runs the data flow of a multi-GPU layout,
            device-to-device copies included; results are unchanged, the
            copies cost time and memory.
        split_points: trace ``module`` with ``torch.fx`` and begin a new
            stage where each named submodule (as in ``named_modules()``:
            ``"layer3"``, ``"blocks.6"``) is first called; ``devices`` then
            has ``len(split_points) + 1`` entries. A value one stage produces
            and a later one reads (a skip connection) goes straight there.
            The module is traced again for each kind of call (None
            arguments, training flags: see :mod:`~mpstream.stages.traced`),
            and the pipe starts in the module's mode.
        leaf_modules: with ``split_points``, submodules (qualified names or
            types) not to trace into: each runs whole inside one stage.
        tracer: with ``split_points``: ``'auto'`` (default) splits a Hugging
            Face model with ``torch.export`` and any other module with
            ``torch.fx``, falling back to ``torch.export`` where ``torch.fx``
            fails; ``'fx'`` or ``'export'`` uses only that one.
            ``torch.export`` needs an example call: ``sample=`` (a dict of
            keyword arguments, a tuple or the one input), a Hugging Face
            model's ``dummy_inputs``, or else the first call, which then
            splits the module and places its tensors on ``devices``
            (``parameters()``, ``state_dict()``, ``train()`` and dtype
            conversion work before it; ``graph``, ``partitions``,
            ``balance`` and ``schedule_for`` raise ``RuntimeError`` until
            it). It exports again for a call of another kind (other
            arguments, shapes beyond the batch dimension, training mode or
            dtypes). :meth:`split_report` says which tracer split the
            module and why.
        compile: ``True`` or a dict of ``torch.compile`` keyword arguments
            (e.g. ``{"backend": "aot_eager"}``): each stage's partition is
            compiled. The layers stay registered uncompiled, so
            ``state_dict`` keys do not change.
        graphs: replay each CUDA stage's forward and backward from CUDA
            graphs, captured the first time each kind of call is seen, one
            set per micro-batch the schedule keeps in flight on the stage
            (see :mod:`mpstream.runtime.graphed`). The host then issues a few
            launches per task instead of every kernel. Serves ``pipe(x)``,
            ``loss.backward()``, ``train_step`` and every schedule (a
            zero-bubble schedule's input and weight passes as graphs of
            their own); a stage that cannot be captured (a CPU stage, a
            host sync) runs eagerly with a warning; :meth:`graph_report`
            says what is graphed. The graphs add the parameter gradients
            into buffers of each stage's, which the parameters' ``.grad``
            are (views; ``zero_grad()`` and optimizers work as usual); so
            ``torch.autograd.grad`` gives no parameter gradient through a
            graphed stage, and ``loss_fn`` in :meth:`train_step` receives
            the last stage's output buffers, valid until the micro-batch's
            backward (copy what you keep). A
            :class:`~mpstream.runtime.graphed.Backend` instead of ``True``
            captures with it (``Emulated()`` models replay semantics on any
            device, for tests).

    Raises:
        TypeError: ``module`` is neither an ``nn.Sequential`` nor given
            ``split_points``; tracing and exporting failed (the message
            names the module, each tracer's reason and what to do; without
            ``sample=``, the export fails at the first call instead);
            ``chunks`` or ``split_size`` is not an int.
        ValueError: ``chunks``/``split_size`` < 1 or both given; a layer is
            repeated; a stage spans devices or sits on a device that does not
            exist; balance/devices do not fit; an unknown checkpoint mode,
            schedule or split point; a bad schedule order (shown as a stage x
            step grid); ``virtual_stages`` given for another schedule or not
            fitting the stages and devices; a parameter or buffer shared by
            stages on different devices; ``graphs`` with ``compile``.

    Example::

        model = nn.Sequential(part0.to("cuda:0"), part1.to("cuda:1"))
        pipe = mpstream.Pipe(model, split_size=12)
        loss_fn(pipe(x), y.to("cuda:1")).backward()
    """

    def __init__(
        self,
        module: nn.Module,
        chunks: int | None = None,
        *,
        split_size: int | None = None,
        balance: Sequence[int] | str | None = None,
        devices: Sequence[DeviceLike] | None = None,
        checkpoint: str = "never",
        deferred_batch_norm: bool = False,
        schedule: PipeSchedule = "gpipe",
        sample: Value | None = None,
        force_copies: bool = False,
        split_points: Sequence[str] | None = None,
        leaf_modules: Sequence[str | type[nn.Module]] = (),
        compile: CompileOption = False,
        virtual_stages: int | None = None,
        graphs: bool | Backend = False,
        tracer: str = "auto",
    ) -> None:
        super().__init__()
        check_module(module)  # before anything reads it as a module
        if chunks is not None and split_size is not None:
            raise ValueError("give either chunks or split_size, not both")
        if graphs and compile:
            raise ValueError(
                "graphs=True and compile= both take over how a stage runs; choose one (for "
                "compiled stages replayed as CUDA graphs, compile={'mode': 'reduce-overhead'})"
            )
        if not isinstance(graphs, bool) and not hasattr(graphs, "capture"):
            raise TypeError(f"graphs must be True, False or a graph backend, got {graphs!r}")
        self.__dict__["_graphed"] = graphs or None
        if isinstance(chunks, (list, tuple)):
            raise TypeError(
                f"chunks must be an int, got {type(chunks).__name__}: balance is keyword-only "
                f"(torchgpipe's GPipe(module, {list(chunks)}) is Pipe(module, balance="
                f"{list(chunks)}))"
            )
        self._chunks = None if chunks is None else check_positive("chunks", chunks)
        self._split_size = None if split_size is None else check_positive("split_size", split_size)
        self.checkpoint = checkpoint
        self.__dict__["_compile"] = compile_options(compile)  # before any layer moves
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self.__dict__["_runtime"] = None
        self.force_copies = bool(force_copies)
        # A failure undoes the conversion: the caller's model is as it was.
        with converted(module) if deferred_batch_norm else nullcontext(module) as module:
            built = build(module, balance, devices, sample, split_points, leaf_modules, tracer)
            if built.graph is not None:
                reads = built.graph.reads()
                check_schedule(self.schedule, built.devices, reads, self.virtual_stages)
            elif isinstance(self.schedule, str):  # an order is checked at the first-call split
                check_schedule(self.schedule, built.devices, (), self.virtual_stages)
        if built.layers is not None:
            for name, layer in built.layers:
                self.add_module(name, layer)
        else:
            self._adopt_module(built.root)
        # Not registered: the layers above own the parameters, so state_dict
        # keys stay those of the wrapped module whatever the split.
        self.__dict__["_partitions"] = nn.ModuleList(built.partitions)
        self.__dict__["_devices"] = built.devices
        self.__dict__["_balance"] = built.balance
        self.__dict__["_graph"] = built.graph
        self.__dict__["_root"] = built.root
        self.__dict__["_split_points"] = built.split_points
        self.__dict__["_split"] = built.split  # traced: a split per kind of call
        self.__dict__["_report"] = built.report
        self.__dict__["_deferred"] = None  # found on first use (see _deferred_norms)
        # The pipe starts in the module's mode (a traced forward reads the
        # root's flag), set without touching the layers' own flags.
        self.training = module.training
        for part in built.partitions:
            part.training = module.training
        self.__dict__["_sealed"] = True  # layers and tensors replaced from now on are checked

    # -- running -------------------------------------------------------
    def train_step(
        self,
        inputs: Any,
        target: Any = None,
        loss_fn: Callable[[Any, Any], Tensor] | None = None,
        *,
        reduction: str | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> Tensor:
        """Forward and backward of every micro-batch in :attr:`schedule` order.

        Gradients accumulate into ``.grad`` as if ``loss_fn`` had been applied
        to the whole batch: each micro-batch's loss is weighted by its share
        of the batch (``reduction='mean'``) or by 1 (``reduction='sum'``).
        The weights are exact for a loss that averages uniformly over the
        batch's rows; one that averages over a count that depends on the
        data (``ignore_index``, class ``weight=``) is not a weighted sum of
        its micro-batches' means: give it ``reduction='sum'`` (the step
        follows a loss module's own), and divide by the count yourself.
        Call ``optimizer.step()`` after. Only parameters get gradients:
        inputs and targets are detached.

        Args:
            inputs: the batch: one input, or a tuple of the module's
                positional inputs (split as :meth:`forward` splits them);
                for a traced module, a mapping (a dict, a ``BatchEncoding``)
                whose keys are strings, one at least naming a parameter of
                its ``forward``, is its keyword arguments (a Hugging Face
                batch).
            target: targets split the same way (any structure of tensors
                and plain values) and moved to the last stage's device;
                None with no ``loss_fn``.
            loss_fn: ``loss_fn(output, target) -> scalar`` per micro-batch.
                None: the module computes its loss itself (a Hugging Face
                model given ``labels``, split by ``torch.export``): each
                micro-batch's ``output.loss``, already weighted by its
                share of the batch, so ``reduction`` does not apply.
            reduction: how ``loss_fn`` reduces over the batch, ``'mean'``
                or ``'sum'``; default: a loss module's own (its
                ``reduction``), else ``'mean'``.
            scaler: a ``torch.amp.GradScaler``: each micro-batch's weighted
                loss is scaled by ``scaler.scale`` before its backward, so the
                gradients are scaled; call ``scaler.step(optimizer)`` and
                ``scaler.update()`` after, as usual.

        Returns:
            The whole-batch loss (detached, unscaled), on the last stage's
            device.

        Raises:
            TypeError: bad inputs or targets, a stage returned an unsupported
                value, ``loss_fn`` returned something other than a scalar
                tensor (or was not given for a module that returns no
                ``loss``), or ``scaler`` is not a ``GradScaler``.
            ValueError: empty batch, targets of another batch size, or an
                unknown ``reduction`` or one the loss module contradicts.
            RuntimeError: called under ``torch.inference_mode()``.

        Inputs and targets in host memory move in transfer tasks that never
        block the host (see :meth:`forward`). If anything raises, the
        gradients (a loss module's too, not those of other tensors
        ``loss_fn`` reads) and BatchNorm statistics are restored to what
        they were before the call. For that, each stage's existing
        gradients (under gradient accumulation) are cloned on its stream when its first
        backward of the step begins; a step that starts with no gradients,
        or fails before the backward, clones nothing. A step being captured
        in a CUDA graph (:class:`~mpstream.CapturedStep`) takes no snapshot:
        capture cannot be undone by running restores.
        """
        if torch.is_inference_mode_enabled():
            raise RuntimeError(
                "train_step was called under torch.inference_mode(), where nothing can be "
                "trained; call it outside that block (it enables gradients itself, so under "
                "torch.no_grad() it works)"
            )
        given = (inputs, target, loss_fn)  # what schedule='auto' profiles, as given
        if loss_fn is not None:
            reduction = step_reduction(reduction, loss_fn)
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        # Parameter gradients only: inputs are detached, so whether x.grad
        # fills cannot depend on where the batch sits.
        split = self.__dict__["_split"]
        args = self._step_inputs(inputs)
        if loss_fn is None:
            loss_fn, reduction = own_loss(split, target), "sum"
        args = detached(args)
        labels = detached(target)
        micro = scatter(args, self._chunks, self._split_size)
        micro_targets = (
            [None] * len(micro)
            if target is None
            else scatter(labels, self._chunks, self._split_size, "target")
        )
        sizes = micro_sizes(args, self._chunks, self._split_size)
        batch = sum(sizes)
        target_sizes = (
            sizes if target is None else micro_sizes(labels, self._chunks, self._split_size)
        )
        if target_sizes != sizes:
            raise ValueError(
                f"target has batch size {sum(target_sizes)} but inputs have {batch}"
                if sum(target_sizes) != batch
                else f"target splits into micro-batches {target_sizes}, inputs into {sizes}"
            )
        weights = [n / batch if reduction == "mean" else 1.0 for n in sizes]
        self._choose_schedule(*given, len(micro))
        schedule = self.schedule_for(
            len(micro),
            batch_device(args),
            training_step=True,
            target_device=None if target is None else batch_device(labels),
        )
        _, worker, _ = self._rt()
        segmenting = self.__dict__.get("_segmenting")
        issue = None
        if segmenting is not None:
            schedule, issue = segmenting.issue(worker.sched, schedule)
        staging = self._stage(args, self.devices[0])
        target_staging = None if target is None else self._stage(labels, self.devices[-1])
        # Under CUDA graph capture a snapshot's clones would be recorded, not
        # run, and then run on every replay, holding a copy of every gradient.
        graphs = worker.graphs
        snapshot = None
        if not capturing(self.devices):
            saved = graphs.save() if graphs is not None else None
            snapshot = Snapshot(self._norms(), self._stage_params(), loss_fn, saved)
        try:
            with torch.enable_grad():
                stop = self._prepare(len(micro))
                losses = run_step(
                    worker,
                    micro,
                    micro_targets,
                    schedule,
                    loss_fn,
                    weights,
                    stop,
                    staging,
                    target_staging,
                    None if snapshot is None else snapshot.save_grads,
                    None if scaler is None else scaler.scale,
                    issue,
                )
        except BaseException as exc:
            if snapshot is not None:
                try:
                    if graphs is not None:
                        graphs.restore(keep=False)
                    snapshot.restore()
                except Exception as cleanup:  # a sticky device error: exc stays the one raised
                    annotate(exc, f"mpstream: restoring the state raised too: {cleanup!r}")
            raise
        if graphs is not None:
            graphs.restore(keep=True)
        return torch.stack(losses).sum()

    def _norms(self) -> Norms:
        """The pipe's BatchNorm buffers for a step's snapshot, found again only
        when a module registered something or a buffer moved."""
        found = self.__dict__.get("_norm_buffers")
        now = generation()
        if found is None or found[0] != now or found[1].stale():
            found = (now, Norms(self))
            self.__dict__["_norm_buffers"] = found
        return found[1]  # type: ignore[no-any-return]

    def _stage_params(self) -> list[list[nn.Parameter]]:
        """Each stage's parameters, found again only when a module
        registered something (a walk over every module costs)."""
        found = self.__dict__.get("_param_lists")
        now = generation()
        if found is None or found[0] != now:
            found = (now, [list(part.parameters()) for part in self.__dict__["_partitions"]])
            self.__dict__["_param_lists"] = found
        return found[1]  # type: ignore[no-any-return]

    def _step_inputs(self, inputs: Any) -> tuple[Any, ...]:
        """``train_step``'s ``inputs`` as the pipeline's positional inputs (a
        traced module switched to the split of their kind)."""
        split = self.__dict__["_split"]
        root = self.__dict__["_root"]
        if isinstance(inputs, Mapping) and split is not None and keywords_of(root, inputs):
            # Keyword arguments (a Hugging Face batch, a tokenizer's BatchEncoding).
            return self._inputs((), dict(inputs))
        if split is not None and isinstance(inputs, tuple):
            return self._inputs(inputs, {})
        return self._inputs((inputs,), {})

    def train(self, mode: bool = True) -> Pipe:
        """Sets training mode on the layers, the partition wrappers and a
        traced module's root (not registered on the pipe), whose flag its
        ``forward`` may read."""
        super().train(mode)
        self.__dict__["_partitions"].train(mode)  # none before a first-call split
        root = self.__dict__["_root"]
        if root is not None:
            root.training = mode
        return self

    def extra_repr(self) -> str:
        split = (
            f"split_size={self._split_size}" if self._split_size else f"chunks={self._chunks or 1}"
        )
        devs = ", ".join(str(d) for d in self.__dict__["_devices"])
        balance = self.__dict__["_balance"]
        cut = f"balance={balance}" if balance is not None else "split at the first call"
        return f"{split}, {cut}, devices=[{devs}]"

"""``mpstream.Pipe``: a module pipelined over devices and streams.

Its construction; a call, ``pipe(x)``, is
:class:`~mpstream.pipe.call.PipeCall`'s and the training step
:class:`~mpstream.pipe.step.PipeStep`'s, which it extends.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from torch import nn

from ..memory.batchnorm import converted, deferred_norms
from ..runtime.graphed import Backend, grads_zeroed
from ..runtime.microbatch import Value
from ..runtime.ordered_writes import ordered_write
from ..schedules.schedule import PipeSchedule, check_schedule
from ..stages.build import build, check_module
from ..stages.sequential import DeviceLike, check_flag, check_positive
from ..stages.undo import undone_on_error
from .compiling import CompileOption, compile_options
from .step import PipeStep

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

__all__ = ["Pipe"]


class Pipe(PipeStep):
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
            the calls of its children, of their ModuleList/Sequential
            items, and of the items of one a child holds (ViT's
            ``encoder.layers``).
        devices: one device per stage (several stages may share a device).
            Without it, stage ``s`` goes to ``cuda:s`` (the CPU without
            CUDA), as torchgpipe placed them; a Sequential given neither
            ``balance`` nor ``devices`` stays where its children are.
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
            (:meth:`schedule_report`); or your own order: a list of
            actions, or one string of them separated by spaces
            (``['F0m0', 'F1m0', 'B1m0', 'B0m0']`` or
            ``'F0m0 F1m0 B1m0 B0m0'``; see :mod:`mpstream.schedules.orders`;
            ``str(pipe.schedule_for(...))`` prints a built-in one to start
            from). ``pipe(x)`` always runs fill-drain.
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
            ``torch.autograd.grad`` (and ``backward(inputs=...)`` naming a
            graphed stage's parameters) gives no parameter gradient through
            a graphed stage, and ``loss_fn`` in :meth:`train_step` receives
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
            ``chunks`` or ``split_size`` is not an int;
            ``deferred_batch_norm`` or ``force_copies`` is not a bool.
        ValueError: ``chunks``/``split_size`` < 1 or both given; a layer is
            repeated; a stage spans devices or sits on a device that does not
            exist; balance/devices do not fit; an unknown checkpoint mode,
            schedule or split point; a bad schedule order (shown as a stage x
            step grid); ``virtual_stages`` given for another schedule or not
            fitting the stages and devices; a parameter or buffer shared by
            stages on different devices; ``graphs`` with ``compile``; a
            layer or tensor named as one of Pipe's own attributes
            (``schedule``, ``balance``, ...; the model is left as it was); a
            parameter or buffer on the ``meta`` device (materialise the
            module first).

    Example::

        model = nn.Sequential(part0.to("cuda:0"), part1.to("cuda:1"))
        pipe = mpstream.Pipe(model, split_size=12)
        loss_fn(pipe(x), y.to("cuda:1")).backward()
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # torchgpipe took balance second: GPipe(module, [2, 2], chunks=8).
        # Here that list binds to chunks, and with chunks= also given Python
        # refuses the call ("multiple values for argument 'chunks'") before
        # __init__ runs, so the list is caught here, where it is seen first.
        if len(args) > 1 and isinstance(args[1], (list, tuple)):
            balance = list(args[1])
            raise TypeError(
                f"chunks must be an int, got {type(args[1]).__name__}: balance is keyword-only "
                f"(torchgpipe's GPipe(module, {balance}) is Pipe(module, balance={balance}))"
            )
        return super().__new__(cls)

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
        # Validated first: an empty dict compiles with torch.compile's defaults.
        options = compile_options(compile)
        if graphs and options is not None:
            raise ValueError(
                "graphs=True and compile= both take over how a stage runs; choose one (for "
                "compiled stages replayed as CUDA graphs, compile={'mode': 'reduce-overhead'})"
            )
        if not isinstance(graphs, bool) and not hasattr(graphs, "capture"):
            raise TypeError(f"graphs must be True, False or a graph backend, got {graphs!r}")
        self.__dict__["_graphed"] = graphs or None
        deferred_batch_norm = check_flag("deferred_batch_norm", deferred_batch_norm)
        self._chunks = None if chunks is None else check_positive("chunks", chunks)
        self._split_size = None if split_size is None else check_positive("split_size", split_size)
        self.checkpoint = checkpoint
        self.__dict__["_compile"] = options
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self.__dict__["_runtime"] = None
        self.force_copies = force_copies
        # A failure undoes the moves and the conversion: the caller's model is as it was.
        with (
            undone_on_error(module),
            converted(module) if deferred_batch_norm else nullcontext(module) as module,
        ):
            if options is not None and options.get("fullgraph") and deferred_norms(module):
                # Their accumulation runs outside torch.compile (a graph break
                # per layer); dynamo's own error would name mpstream's code.
                raise ValueError(
                    "compile={'fullgraph': True} cannot hold deferred BatchNorm layers, whose "
                    "statistics are accumulated outside the compiled graph: drop fullgraph, or "
                    "build without them (deferred_batch_norm=False)"
                )
            built = build(module, balance, devices, sample, split_points, leaf_modules, tracer)
            if built.graph is not None:
                reads = built.graph.reads()
                check_schedule(self.schedule, built.devices, reads, self.virtual_stages)
            elif isinstance(self.schedule, str):  # an order is checked at the first-call split
                check_schedule(self.schedule, built.devices, (), self.virtual_stages)
            # Inside the block: a name clashing with the pipe's own leaves the
            # caller's model unmoved and unconverted too.
            if built.layers is not None:
                for name, layer in built.layers:
                    self._adopt(name, layer, self.add_module)
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
        self._seal()  # layers and tensors replaced from now on are checked

    # -- running -------------------------------------------------------
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, which graphed stages see even in the
        middle of a pass: a ``train_step``'s ``loss_fn``, or a hook, may
        call it, and the micro-batches after it add into fresh gradients, as
        eager autograd's do. In a backward pass of your own loop, graphed
        stages add as they run, where autograd accumulates a parameter once
        the pass is done with it: a parameter they added into both before
        and after the zeroing holds only the part after, and a
        ``GraphWarning`` names it (zero before the backward, or use
        ``graphs=False``; see docs/tuning.md).

        Zeroed in place mid-pass, on the current streams, the gradients are
        ordered on the device as the host issued the calls: after the
        stages' adds queued before, before those queued after.

        Args:
            set_to_none: set ``.grad`` to None rather than zero it in place.
        """
        if set_to_none:
            super().zero_grad(set_to_none)
        else:
            with ordered_write(self.__dict__.get("_scheduler")):
                super().zero_grad(set_to_none)
        grads_zeroed(self.parameters())

    def extra_repr(self) -> str:
        split = (
            f"split_size={self._split_size}" if self._split_size else f"chunks={self._chunks or 1}"
        )
        devs = ", ".join(str(d) for d in self.__dict__["_devices"])
        balance = self.__dict__["_balance"]
        cut = f"balance={balance}" if balance is not None else "split at the first call"
        return f"{split}, {cut}, devices=[{devs}]"

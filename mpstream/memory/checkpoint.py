"""Activation checkpointing of pipeline stages.

A checkpointed stage keeps only its input; autograd recomputes its forward
during backward, on the stage's own compute stream (the recomputation is
triggered by the first backward node that needs a saved tensor, and autograd
runs each node on the stream its forward used). RNG state is restored so
dropout draws the same masks. ``torch.utils.checkpoint`` does the work; this
module adds the policy (which micro-batches), a recompute context that keeps
BatchNorm running statistics from being updated a second time, the flags
:func:`is_checkpointing` and :func:`is_recomputing` that let a module skip
side effects once, and a fresh copy of the stage input for each run, so a
stage may begin with an in-place op.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils import _pytree as pytree
from torch.utils import checkpoint as torch_checkpoint

__all__ = [
    "MODES",
    "check_mode",
    "checkpoint_stop",
    "is_checkpointing",
    "is_recomputing",
    "checkpointed",
    "graph_writes",
    "run_eagerly",
    "stage_call",
]

MODES = ("always", "except_last", "never")

_local = threading.local()


def check_mode(mode: object) -> str:
    """Validates a checkpoint mode.

    Raises:
        ValueError: ``mode`` is not one of :data:`MODES`.
    """
    if mode not in MODES:
        valid = ", ".join(repr(m) for m in MODES)
        raise ValueError(f"checkpoint must be one of {valid}; got {mode!r}")
    return str(mode)


def checkpoint_stop(mode: str, micros: int, training: bool) -> int:
    """How many leading micro-batches are checkpointed.

    ``'except_last'`` spares the last micro-batch, whose backward starts
    right after its forward; eval mode and ``'never'`` checkpoint nothing.
    """
    if not training or mode == "never":
        return 0
    if mode == "except_last":
        return micros - 1
    return micros


def is_checkpointing() -> bool:
    """Whether the calling thread runs the first forward of a checkpointed stage.

    True while a stage computes a micro-batch whose activations are dropped
    and recomputed during backward; the recomputation then runs with
    :func:`is_recomputing` true instead. A module with a side effect (a
    counter, a cache, a log line) runs it once per micro-batch by skipping it
    when ``is_recomputing()``; one that prepares something only its
    recomputation needs does so when ``is_checkpointing()``.

    Returns:
        True inside a checkpointed forward, False elsewhere (plain forwards,
        eval mode, recomputation, outside a pipeline).
    """
    return bool(getattr(_local, "checkpointing", False))


def is_recomputing() -> bool:
    """Whether the calling thread is recomputing a checkpointed stage.

    Returns:
        True while autograd recomputes a checkpointed micro-batch's forward
        during backward, False elsewhere.
    """
    return bool(getattr(_local, "recomputing", False))


@contextmanager
def _checkpointing() -> Iterator[None]:
    previous = getattr(_local, "checkpointing", False)
    _local.checkpointing = True
    try:
        yield
    finally:
        _local.checkpointing = previous


@contextmanager
def _recompute(stage: nn.Module) -> Iterator[None]:
    # The recomputation sees the same batch as the original forward, so
    # BatchNorm normalises identically; only its running statistics must not
    # be updated twice. They are saved before and put back after: both run on
    # the stage's stream in order, and the buffers are small. (Changing
    # track_running_stats instead would change what batch_norm saves for
    # backward, which the checkpoint's determinism check rejects.) The copy
    # goes through .data so the buffers' version counters do not move:
    # other micro-batches' graphs saved them, as batch_norm does.
    written = _written_buffers(stage)
    saved = [b.clone() for b in written]
    previous = getattr(_local, "recomputing", False)
    # A recomputation can run inside a checkpointed forward (a module calling
    # torch.autograd.grad in its forward): inside it, only recomputing holds.
    outer = getattr(_local, "checkpointing", False)
    _local.recomputing, _local.checkpointing = True, False
    try:
        yield
    finally:
        _local.recomputing, _local.checkpointing = previous, outer
        for b, copy in zip(written, saved):
            b.data.copy_(copy)


def _written_buffers(stage: nn.Module) -> list[Tensor]:
    """The buffers a forward of ``stage`` updates: those of its BatchNorm
    and InstanceNorm layers that track running statistics, and those an
    exported graph (where BatchNorm is an aten op on the stage's own
    buffers) hands to an operator that writes them. Read
    anew each time: ``.to()`` or a conversion replaces buffers."""
    seen: dict[int, Tensor] = {}
    for m in stage.modules():
        if isinstance(m, _NormBase) and m.track_running_stats:
            seen.update((id(b), b) for b in m.buffers(recurse=False))
        elif isinstance(m, fx.GraphModule):
            seen.update((id(b), b) for b in graph_writes(m))
    return list(seen.values())


def graph_writes(gm: fx.GraphModule, statistics: bool = False) -> list[Tensor]:
    """The buffers of ``gm`` (an exported stage's graph) that its graph
    hands to an operator that writes them.

    Args:
        gm: the graph module.
        statistics: only those handed to a norm operator in training
            mode as its running statistics (``running_mean``,
            ``running_var``), which it writes.

    Returns:
        The buffers, each once.
    """
    found = _GRAPH_WRITES.get(gm)
    if found is None:
        found = _GRAPH_WRITES[gm] = _graph_writes(gm)
    return list(map(gm.get_buffer, found[statistics]))


# Per graph module, what :func:`_graph_writes` found (its graph never changes).
_GRAPH_WRITES: weakref.WeakKeyDictionary[
    fx.GraphModule, tuple[tuple[str, ...], tuple[str, ...]]
] = weakref.WeakKeyDictionary()


_STATISTICS = ("running_mean", "running_var")


def _graph_writes(gm: fx.GraphModule) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names of the buffers of ``gm`` that its graph passes to an
    operator's argument that the operator's schema marks as written
    (``Tensor(a!)``), or as running statistics; and those of the latter
    that the operator writes (not a norm in eval mode's)."""
    buffers = {name for name, _ in gm.named_buffers()}
    out: dict[str, None] = {}
    stats: dict[str, None] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema.arguments
        args = [
            *zip(schema, node.args),
            *((a, node.kwargs[a.name]) for a in schema if a.name in node.kwargs),
        ]
        # A norm in eval mode reads its statistics: its operator's training
        # argument is False (or it is the no-training overload).
        reads = node.target._schema.name.endswith("_no_training") or any(
            a.name == "training" and v is False for a, v in args
        )
        for arg, value in args:
            info = arg.alias_info
            # batch_norm and its kin update running statistics their schema
            # does not mark as written.
            if not (info is not None and info.is_write) and arg.name not in _STATISTICS:
                continue
            if isinstance(value, fx.Node) and value.op == "get_attr" and value.target in buffers:
                out[str(value.target)] = None
                if arg.name in _STATISTICS and not reads:
                    stats[str(value.target)] = None
    return tuple(out), tuple(stats)


class _OnACopy:
    """Calls a stage on a copy of its inputs' tensors.

    The checkpoint keeps the inputs to recompute from. A stage that begins
    with an in-place op (``ReLU(inplace=True)``) would otherwise overwrite
    them in its first forward, and again in the recomputation, which
    autograd rejects (and which would recompute from the wrong values). The
    copy costs one read and write of the stage input per run and lives only
    until the first layer has consumed it; the copy's backward is the
    identity.
    """

    __slots__ = ("stage",)

    def __init__(self, stage: nn.Module) -> None:
        self.stage = stage

    def __call__(self, *args: Any) -> Any:
        copied = pytree.tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, args)
        return self.stage(*copied)


# Called with the stage a checkpoint runs, then None (StageSavedBytes charges
# the inputs the checkpoint keeps to that stage: they are saved before the
# stage's own forward hooks run).
stage_watchers: list[Callable[[nn.Module | None], None]] = []


def checkpointed(stage: nn.Module, *args: Any) -> Any:
    """Runs ``stage(*args)`` keeping only ``args``; backward recomputes the rest.

    The stage runs on a copy of its inputs (see :class:`_OnACopy`), under
    :func:`is_checkpointing` the first time and :func:`is_recomputing` in
    the recomputation, both under the caller's autocast state (which
    ``torch.utils.checkpoint`` records and restores). The recomputation
    draws the same random numbers: the RNG state of the CPU and of the
    inputs' devices is restored for it.
    """
    items = pytree.tree_leaves(args)
    on_cpu = not any(isinstance(t, Tensor) and t.device.type != "cpu" for t in items)

    def contexts() -> tuple[Any, Any]:
        # Inputs on the CPU alone: torch would also watch the default device
        # type's RNG (CUDA's) and refuse a forward that initialises CUDA on
        # the way, which torch.compile's first call does on a GPU machine,
        # although a CPU stage draws nothing from it. The CPU generator is
        # all that needs keeping; context_fn runs just before the forward.
        if on_cpu:
            state = torch.get_rng_state()
            return _checkpointing(), _Reentrant(lambda: _recompute_on_cpu(stage, state))
        return _checkpointing(), _Reentrant(lambda: _recompute(stage))

    watchers = list(stage_watchers)
    for watch in watchers:
        watch(stage)
    try:
        return torch_checkpoint.checkpoint(
            _OnACopy(stage),
            *args,
            use_reentrant=False,
            preserve_rng_state=not on_cpu,
            context_fn=contexts,
        )
    except BaseException as exc:
        _end_forward_contexts(exc)
        raise
    finally:
        for watch in watchers:
            watch(None)


def run_eagerly(stage: nn.Module, args: Sequence[Any], checkpoint: bool) -> Any:
    """Runs ``stage(*args)`` eagerly: through :func:`checkpointed` when ``checkpoint``.

    Every eager stage forward of a run is this (a forward run's, a training
    step's, a graphed stage's that runs eagerly), and every captured one is
    :func:`stage_call`'s: both choose alike.
    """
    return checkpointed(stage, *args) if checkpoint else stage(*args)


def stage_call(stage: nn.Module, checkpoint: bool) -> Callable[..., Any]:
    """What :func:`run_eagerly` calls, as a callable taking the arguments
    (what a graph captures): ``stage`` itself, or :func:`checkpointed` on it
    when ``checkpoint``."""
    return partial(checkpointed, stage) if checkpoint else stage


def _end_forward_contexts(exc: BaseException) -> None:
    """Exits the checkpoint contexts a failed forward left entered.

    ``torch.utils.checkpoint.checkpoint`` (non-reentrant) runs the function
    between two steps of a generator that holds its saved-tensor hooks and
    ``context_fn``'s forward context entered. In torch 2.11 (the GPU
    machine's) a forward that raises leaves that generator suspended inside
    both for as long as the exception's traceback, which holds it, lives:
    :func:`is_checkpointing` stays true, and every later backward in the
    thread unpacks its saved tensors through the dead checkpoint, rerunning
    the failed forward (and raising its error again). Closing the generator
    exits both. Torch 2.15 exits them itself: the generator is done by then,
    and nothing here runs. An error while exiting them is noted on ``exc``,
    which stays the one raised.
    """
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_globals.get("__name__") == torch_checkpoint.__name__:
            gen = frame.f_locals.get("gen")
            if inspect.isgenerator(gen) and gen.gi_frame is not None:
                try:
                    gen.close()
                except Exception as cleanup:
                    add_note = getattr(exc, "add_note", None)  # Python 3.11+
                    if add_note is not None:
                        add_note(
                            f"exiting the failed checkpoint's contexts raised "
                            f"{type(cleanup).__name__}: {cleanup}"
                        )
        tb = tb.tb_next


class _Reentrant:
    """A context manager made anew at each entry: ``torch.utils.checkpoint``
    enters its recompute context once per recomputation, and a second
    backward through the graph (``retain_graph=True``, a double backward)
    recomputes again."""

    def __init__(self, make: Callable[[], AbstractContextManager[None]]) -> None:
        self._make = make
        self._open: list[AbstractContextManager[None]] = []

    def __enter__(self) -> None:
        context = self._make()
        context.__enter__()
        self._open.append(context)

    def __exit__(self, *exc: Any) -> bool | None:
        return self._open.pop().__exit__(*exc)


@contextmanager
def _recompute_on_cpu(stage: nn.Module, rng_state: Tensor) -> Iterator[None]:
    """:func:`_recompute`, drawing from the CPU generator as the forward did."""
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng_state)
        with _recompute(stage):
            yield

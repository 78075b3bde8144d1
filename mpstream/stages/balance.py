"""Automatic balancing: profile each layer, split to minimise the slowest stage.

:func:`profile_layers` runs an ``nn.Sequential`` layer by layer on a sample
batch, in training mode (the mode a pipeline is balanced for, whatever mode
the module is in), and measures each layer's forward + backward time, the
bytes it keeps for backward plus its output, and its parameter (and
gradient) bytes; ``balance_by_size`` can add the optimizer's state.
:func:`~.partition.partition` then finds the contiguous split into
``stages`` parts whose largest cost is smallest. :func:`profile_units`
does the same for a traced module's units, in the module's own mode: the
mode the pipe first traces it in, so the split points it picks exist there.
"""

from __future__ import annotations

import copy
import functools
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from .._words import count_of
from ..runtime.boundary import GradSink, cut
from ..runtime.calls import takes_several
from ..runtime.errors import annotate
from ..runtime.microbatch import NoChunk, Value, as_value, leaves, rebuild_leaves
from ..runtime.stream import as_device
from .fx import call_units, trace
from .module_hooks import entering
from .partition import partition
from .sequential import check_device_exists
from .tracers import call_arguments, nones_of, sample_call

__all__ = [
    "LayerProfile",
    "profile_layers",
    "profile_call",
    "profile_units",
    "split_points_by",
    "balance_by_time",
    "balance_by_size",
]


@dataclass(frozen=True)
class LayerProfile:
    """What one layer costs on the profiled sample."""

    name: str
    forward_ms: float
    backward_ms: float
    activation_bytes: int
    parameter_bytes: int
    output_bytes: int = 0

    @property
    def time_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    @property
    def size_bytes(self) -> int:
        return self.activation_bytes + self.parameter_bytes

    def training_bytes(self, param_scale: float = 0.0) -> float:
        """:attr:`size_bytes` plus ``param_scale`` bytes of optimizer state per parameter byte."""
        # parameter_bytes counts each parameter twice: itself and its gradient.
        return self.size_bytes + param_scale * self.parameter_bytes / 2


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _note_storage(saved: dict[int, int], t: Tensor) -> Tensor:
    saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return t


def profile_layers(
    module: nn.Module,
    sample: Value,
    *,
    device: torch.device | str | None = None,
    repeat: int = 3,
) -> list[LayerProfile]:
    """Measures every layer of an ``nn.Sequential`` on ``sample``.

    A deep copy of ``module`` is profiled on ``device`` (default: where the
    module's first parameter is), in training mode (dropout active,
    BatchNorm on batch statistics: what the pipeline trains with), so the
    module itself, its mode included, is left untouched. Times are medians
    over ``repeat`` runs after one warm-up, synchronised.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
    """
    if not isinstance(module, nn.Sequential):
        hint = ""
        if isinstance(module, int) and isinstance(sample, nn.Module):
            hint = (
                " (torchgpipe's argument order, (partitions, module, sample), is "
                "(module, sample, stages) here)"
            )
        elif isinstance(module, nn.Module):
            hint = (
                "; for another module, Pipe(module, balance='time' or 'size', devices=..., "
                "sample=...) picks split points among its children's calls"
            )
        raise TypeError(
            f"balancing profiles an nn.Sequential layer by layer; got {type(module).__name__}{hint}"
        )
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    first = next(module.parameters(), None)
    dev = (
        check_device_exists(as_device(device, "device"), "device")
        if device is not None
        else (first.device if first is not None else torch.device("cpu"))
    )
    model = copy.deepcopy(module).to(dev).train()
    # The pipeline's positional inputs, passed on as its stages pass them
    # (runtime.calls.Chain: a tuple spread into a layer taking several).
    # A pipe's call may also hold NoChunk tensors and plain values (a mask,
    # a scale): its layers get those whole, and only the rest is one batch.
    given = tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)
    batch = tuple(x for x in given if isinstance(x, Tensor))
    as_value(batch or sample, "sample")
    args: tuple[Any, ...] = tuple(
        (x.tensor if isinstance(x, NoChunk) else x).to(dev)
        if isinstance(x, (Tensor, NoChunk))
        else x
        for x in given
    )
    out: list[LayerProfile] = []
    counted: set[int] = set()
    for name, layer in model.named_children():
        if takes_several(layer):
            if len(args) == 1 and isinstance(args[0], tuple):
                args = args[0]
        elif len(args) > 1:
            args = (args,)
        try:
            profile, y = profile_call(name, layer, args, dev, repeat, counted)
        except Exception as exc:
            annotate(
                exc,
                f"mpstream: raised while profiling layer {len(out)} ('{name}') to balance the "
                f"stages: the sample must be a batch the whole module takes (run "
                f"module(sample) to check)",
            )
            raise
        out.append(profile)
        args = (pytree.tree_map(lambda v: v.detach() if isinstance(v, Tensor) else v, y),)
    return out


def profile_call(
    name: str,
    layer: nn.Module,
    args: tuple[Any, ...],
    device: torch.device,
    repeat: int,
    counted: set[int] | None = None,
) -> tuple[LayerProfile, Any]:
    """Times ``layer(*args)`` forward and backward and counts its bytes.

    Args:
        counted: ids of parameters an earlier layer already counted (a tied
            weight is held once); this layer's are added to it.

    Returns:
        The profile, and the layer's output (of the last run).
    """
    fwd, bwd = [], []
    saved: dict[int, int] = {}
    y: Any = None
    items, spec = leaves(args)
    where = [i for i, t in enumerate(items) if isinstance(t, Tensor)]
    # Dropout in the profiled runs draws from the global generators: without
    # the fork, building a pipe with balance='time' would change what the
    # caller's seeded training draws next.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i in range(repeat + 1):
            # Non-leaf inputs that require grad: layers may start in place.
            cut_items = list(items)
            for j, t in zip(where, cut(GradSink(), tuple(items[k] for k in where))):
                cut_items[j] = t
            call_args = rebuild_leaves(cut_items, spec)
            saved.clear()
            pack = functools.partial(_note_storage, saved)
            _sync(device)
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = layer(*call_args)
            _sync(device)
            middle = time.perf_counter()
            outs = [t for t in leaves(y)[0] if isinstance(t, Tensor) and t.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            _sync(device)
            end = time.perf_counter()
            if i > 0:
                fwd.append((middle - start) * 1e3)
                bwd.append((end - middle) * 1e3)
            layer.zero_grad(set_to_none=True)
    own = [p for p in layer.parameters() if counted is None or id(p) not in counted]
    if counted is not None:
        counted.update(id(p) for p in own)
    params = sum(_nbytes(p) for p in own)
    output = sum(_nbytes(t) for t in leaves(y)[0] if isinstance(t, Tensor))
    fwd_ms, bwd_ms = statistics.median(fwd), statistics.median(bwd)
    profile = LayerProfile(name, fwd_ms, bwd_ms, sum(saved.values()) + output, 2 * params, output)
    return profile, y


def profile_units(
    module: nn.Module,
    sample: Any,
    *,
    device: torch.device | str | None = None,
    repeat: int = 3,
    leaf_modules: Sequence[str | type[nn.Module]] = (),
) -> tuple[list[str], list[LayerProfile]]:
    """Measures a traced module unit by unit: the calls of its children and
    of the items of its ``nn.ModuleList`` / ``nn.Sequential`` children.

    A deep copy, in the module's mode (as the pipe first traces it), is
    split before every unit with ``torch.fx`` and each part profiled on
    what it reads (see :func:`profile_call`).

    Args:
        module: a module ``torch.fx`` can trace.
        sample: an example call (see :func:`~mpstream.stages.tracers.sample_call`:
            a tuple of positional arguments, a dict of keyword arguments, or
            the one input).

    Returns:
        The names a split point may take (one per part after the first), and
        a profile per part.

    Raises:
        TypeError: a module the traces enter holds a hook, refused before it
            runs (see :func:`~mpstream.stages.module_hooks.entering`).
    """
    first = next(module.parameters(), None)
    dev = (
        check_device_exists(as_device(device, "device"), "device")
        if device is not None
        else (first.device if first is not None else torch.device("cpu"))
    )
    model = copy.deepcopy(module).to(dev)  # in its mode, as the pipe first traces it
    args, kwargs = sample_call(sample)
    # Its None arguments fixed (and the keys it leaves out), as the pipe
    # traces a call of the sample's kind.
    values = call_arguments(model, args, kwargs)
    nones = nones_of(values, reads=True)
    # A hook on a module the traces enter would run on their proxies: refused
    # as the pipe's own trace refuses it, before it runs.
    with entering(model, "fx"):
        points = call_units(model, leaf_modules, nones, values)
        traced = trace(model, points, leaf_modules=leaf_modules, nones=nones, values=values)
    bound = traced.bind(args, kwargs)
    # Every tensor, inside a dict or tuple argument too (a batch {"x": ...}).
    inputs = pytree.tree_map(lambda t: t.to(dev) if isinstance(t, Tensor) else t, bound)
    outs: list[tuple[Any, ...]] = []
    profiles = []
    names = ["(start)", *points]
    counted: set[int] = set()
    for s, (unit, refs) in enumerate(zip(traced.partitions, traced.graph.args)):
        unit_args = tuple(
            _detached(inputs[r.index] if r.stage < 0 else outs[r.stage][r.index]) for r in refs
        )
        profile, y = profile_call(names[s], unit, unit_args, dev, repeat, counted)
        profiles.append(profile)
        outs.append(y if traced.graph.outputs[s] > 1 else (y,))
    return points, profiles


def _detached(value: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, value)


def balance_by_time(
    module: nn.Module,
    sample: Value,
    stages: int,
    *,
    device: torch.device | str | None = None,
    repeat: int = 3,
) -> list[int]:
    """The split of ``module`` into ``stages`` with the smallest slowest stage (time).

    Args:
        module: an ``nn.Sequential``.
        sample: a representative batch (a micro-batch is best).
        stages: number of stages.
        device: where to profile (default: the module's device).
        repeat: timed runs per layer (median).

    Returns:
        The balance: layers per stage.
    """
    profiles = profile_layers(module, sample, device=device, repeat=repeat)
    return partition([p.time_ms for p in profiles], stages)


def balance_by_size(
    module: nn.Module,
    sample: Value,
    stages: int,
    *,
    device: torch.device | str | None = None,
    param_scale: float = 0.0,
) -> list[int]:
    """The split with the smallest largest stage in memory.

    Memory per layer: the bytes it saves for backward plus its output (on
    ``sample``), its parameters and their gradients (a parameter tied to an
    earlier layer's is counted there only), and ``param_scale`` bytes of
    optimizer state per parameter byte.

    Args:
        module: an ``nn.Sequential``.
        sample: a representative batch (a micro-batch is best).
        stages: number of stages.
        device: where to profile (default: the module's device).
        param_scale: optimizer state per parameter byte: 0 for plain SGD,
            1 for SGD with momentum, 2 for Adam (two moments).

    Returns:
        The balance: layers per stage.

    Raises:
        ValueError: ``param_scale`` is negative or not finite.
    """
    scale = float(param_scale)
    if not math.isfinite(scale) or scale < 0:
        raise ValueError(f"param_scale must be a finite number >= 0, got {param_scale!r}")
    profiles = profile_layers(module, sample, device=device, repeat=1)
    return partition([p.training_bytes(scale) for p in profiles], stages)


def split_points_by(
    how: str,
    module: nn.Module,
    sample: Any,
    stages: int,
    *,
    device: torch.device | str | None = None,
    param_scale: float = 0.0,
    leaf_modules: Sequence[str | type[nn.Module]] = (),
) -> list[str]:
    """Split points for a traced module: the contiguous split of its units
    (see :func:`profile_units`) with the smallest slowest stage
    (``how='time'``) or the smallest largest stage in memory (``'size'``).

    Raises:
        ValueError: ``how`` is neither, or fewer units than stages.
    """
    if how not in ("time", "size"):
        raise ValueError(f"balance must be 'time' or 'size'; got {how!r}")
    points, profiles = profile_units(
        module, sample, device=device, repeat=3 if how == "time" else 1, leaf_modules=leaf_modules
    )
    if how == "time":
        costs = [p.time_ms for p in profiles]
    else:
        costs = [float(p.training_bytes(float(param_scale))) for p in profiles]
    if len(costs) < stages:
        raise ValueError(
            f"{type(module).__name__} has {count_of(len(costs), 'unit')} to split "
            f"({', '.join(points)} and what precedes them) but {stages} stages were asked for"
        )
    balance = partition(costs, stages)
    starts = [sum(balance[:k]) for k in range(1, stages)]
    return [points[i - 1] for i in starts]

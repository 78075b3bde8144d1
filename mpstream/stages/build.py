"""How a ``Pipe`` is cut into stages: a Sequential by layers, any module by
``torch.fx`` split points (or ``torch.export``'s, :mod:`~mpstream.stages.exported`,
for a Hugging Face model or where ``torch.fx`` fails), each balanced
automatically on request.

:func:`build` returns the stages, their devices and graph, and what the pipe
registers so that ``state_dict`` keys stay those of the wrapped module: a
Sequential's layers, or a traced module's own children and tensors.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence, Sized
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import nn

from .._words import count_of
from ..memory import DeferredBatchNorm
from ..runtime.graph import StageGraph
from .balance import balance_by_size, balance_by_time, split_points_by
from .export_balance import export_split_points
from .exported import ExportSplit
from .module_hooks import HookError, check_root_hooks
from .sequential import DeviceLike, split_module, stage_devices
from .traced import FxSplit
from .tracers import SplitReport, choose_tracer

__all__ = ["Built", "build", "check_module"]


@dataclass
class Built:
    """A module cut into stages.

    Attributes:
        partitions: one callable module per stage (none yet for a module
            exported at its first call).
        devices: the device of each stage.
        balance: layers per stage (traced operations for a traced module);
            None until a module exported at its first call is split.
        graph: where each stage's arguments come from; None until a
            module exported at its first call is split.
        layers: a Sequential's layers, to register (None when traced).
        root: a traced module, whose children and tensors the pipe adopts.
        split_points: where a traced module's stages begin.
        split: a traced module's split per kind of call.
        report: which tracer split the module and why.
    """

    partitions: list[nn.Module]
    devices: list[torch.device]
    balance: list[int] | None
    graph: StageGraph | None
    layers: list[tuple[str, nn.Module]] | None = None
    root: nn.Module | None = None
    split_points: list[str] | None = None
    split: ExportSplit | FxSplit | None = None
    report: SplitReport | None = None


def check_module(module: object) -> None:
    """Refuses what Pipe cannot split, saying what to do.

    Raises:
        TypeError: ``module`` is a list or tuple of layers (wrap them in
            ``nn.Sequential``, as torch's Pipe and torchgpipe wanted too) or
            not a module at all.
            So is a module holding a hook of its own, which the pipe
            would not run (register it on the Pipe), and a module
            ``torch.compile`` wrapped (give the module and ``compile=True``).
        ValueError: a parameter or buffer is on the ``meta`` device.
    """
    if isinstance(module, nn.Module):
        _check_compiled(module)
        _check_materialised(module)
        check_root_hooks(module)
        return
    kind = type(module).__name__
    if isinstance(module, (list, tuple)) and all(isinstance(m, nn.Module) for m in module):
        raise TypeError(
            f"Pipe takes one nn.Module, got a {kind} of {count_of(len(module), 'module')}: "
            f"wrap them in nn.Sequential(*layers) (each layer is then a stage's unit, balance= "
            f"counts them)"
        )
    raise TypeError(f"Pipe takes an nn.Module to split into stages, got {kind}")


def _check_compiled(module: nn.Module) -> None:
    # torch.compile's wrapper has no forward of its own for torch.fx, and
    # takes *args for torch.export: either tracer's error blamed the code.
    # (No such wrapper exists before torch._dynamo is imported.)
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        raise TypeError(
            f"Pipe was given a torch.compile'd module ({type(module._orig_mod).__name__} "
            f"wrapped), which torch.fx and torch.export cannot split: give the module itself "
            f"(model._orig_mod, its split points named without '_orig_mod.') and compile=True, "
            f"which compiles each stage"
        )


def _check_materialised(module: nn.Module) -> None:
    # A model built under torch.device("meta") has shapes but no values:
    # placing it would fail in torch's .to() with advice (to_empty) that
    # leaves the weights uninitialised, so say the whole way out here.
    tensors = chain(module.named_parameters(), module.named_buffers())
    name = next((n for n, t in tensors if t.is_meta), None)
    if name is not None:
        raise ValueError(
            f"{type(module).__name__}'s tensor {name!r} is on the meta device, which holds no "
            f"values to place or run: materialise the module before wrapping it in Pipe "
            f"(module.to_empty(device=...), then initialise it or load_state_dict)"
        )


def build(
    module: nn.Module,
    balance: Sequence[int] | str | None,
    devices: Sequence[DeviceLike] | None,
    sample: Any,
    split_points: Sequence[str] | None,
    leaf_modules: Sequence[str | type[nn.Module]],
    tracer: str = "auto",
) -> Built:
    """Cuts ``module`` into stages and places them (see ``Pipe``'s arguments).

    A module split by ``torch.export`` without ``sample=`` (nor a Hugging
    Face model's ``dummy_inputs``) is cut at its first call instead: the
    :class:`Built` then holds its split, devices and split points, and no
    stages yet.

    Raises:
        TypeError: ``module`` is no module (a list of layers: wrap them in
            ``nn.Sequential``); bad argument types; balance= layer counts for a traced
            module; tracing failed.
        ValueError: balance/devices/split points that do not fit the module,
            devices that do not exist, tensors shared across devices.
    """
    check_module(module)
    if isinstance(leaf_modules, str):  # one name, as split_points may be
        leaf_modules = [leaf_modules]
    _check_applies(module, balance, sample, split_points, leaf_modules, tracer)
    auto = isinstance(balance, str) and not isinstance(module, nn.Sequential)
    if split_points is not None or auto:
        if balance is not None and not isinstance(balance, str):
            raise TypeError(
                "balance= partitions an nn.Sequential by layer counts; a traced module is "
                "split at split_points= (or give no split_points and balance='time'|'size')"
            )
        how, why = choose_tracer(module, tracer)
        if how == "export":
            if leaf_modules:
                raise ValueError(
                    f"leaf_modules= tells torch.fx what not to trace into; "
                    f"{type(module).__name__} is split by torch.export ({why}), which does "
                    f"not use it: drop leaf_modules, or pass tracer='fx'"
                )
            return _exported(module, split_points, balance, devices, sample, why, None)
        try:
            return _traced(module, split_points, balance, devices, sample, leaf_modules, why)
        except TypeError as exc:  # torch.fx could not trace it
            # No export if torch.fx was asked for, or for a hook on a module
            # the trace entered (torch.export enters it too).
            if tracer == "fx" or leaf_modules or isinstance(exc, HookError):
                raise
            return _exported(module, split_points, balance, devices, sample, why, exc)
    if isinstance(balance, str):
        balance = _auto_balance(module, balance, devices, sample)
    stages = split_module(module, balance, devices)
    return Built(
        list(stages.partitions),
        list(stages.devices),
        list(stages.balance),
        StageGraph.chain(len(stages.partitions)),
        layers=list(stages.layers),
        report=SplitReport("nn.Sequential", "an nn.Sequential is split by its layers"),
    )


def _check_applies(
    module: nn.Module,
    balance: Sequence[int] | str | None,
    sample: Any,
    split_points: Sequence[str] | None,
    leaf_modules: Sequence[str | type[nn.Module]],
    tracer: str,
) -> None:
    """Refuses an argument that this way of splitting would ignore.

    Raises:
        ValueError: the argument named, with what to do instead.
    """
    if isinstance(split_points, Mapping):
        # torch.distributed.pipelining's split_spec: its END points would
        # silently begin a stage one module early.
        spec = ", ".join(f"{k!r}: {getattr(v, 'name', v)}" for k, v in split_points.items())
        raise TypeError(
            f"split_points takes a list of the submodule names where stages begin, not a "
            f"split_spec mapping ({{{spec}}}): keep the names of SplitPoint.BEGINNING entries, "
            f"and for SplitPoint.END at a name give the submodule that follows it"
        )
    if isinstance(balance, str) and balance not in ("time", "size"):
        raise ValueError(f"balance must be a list of ints, 'time' or 'size'; got {balance!r}")
    if isinstance(balance, str) and split_points is not None:
        raise ValueError(
            f"balance={balance!r} picks the split points, and split_points= gives them: "
            f"pass one of the two"
        )
    traced = split_points is not None or not isinstance(module, nn.Sequential)
    if traced:
        if leaf_modules and tracer == "export":
            raise ValueError(
                "leaf_modules= tells torch.fx what not to trace into; tracer='export' does "
                "not use it: drop one of the two"
            )
        names = {name for name, _ in module.named_modules()}
        unknown = [n for n in leaf_modules if isinstance(n, str) and n not in names]
        if unknown:
            raise ValueError(
                f"leaf_modules names no submodule of {type(module).__name__}: "
                f"{', '.join(map(repr, unknown))}"
            )
        return
    ignored = [
        name
        for name, given in (
            ("tracer=", tracer != "auto"),
            ("leaf_modules=", bool(leaf_modules)),
            ("sample=", sample is not None and not isinstance(balance, str)),
        )
        if given
    ]
    if ignored:
        raise ValueError(
            f"{', '.join(ignored)}: an nn.Sequential is split by its layers (balance=), "
            f"without tracing{'' if isinstance(balance, str) else ' or profiling'}; drop "
            f"{'it' if len(ignored) == 1 else 'them'}, or give split_points= to trace it"
        )


def _traced(
    module: nn.Module,
    split_points: Sequence[str] | None,
    balance: Sequence[int] | str | None,
    devices: Sequence[DeviceLike] | None,
    sample: Any,
    leaf_modules: Sequence[str | type[nn.Module]],
    why: str,
) -> Built:
    """A module split by ``torch.fx`` at ``split_points`` (or at the points
    ``balance='time'|'size'`` picks on ``sample``)."""
    if isinstance(balance, str) and split_points is None:
        devices = _auto_devices(balance, devices, sample)
        split_points = split_points_by(
            balance, module, sample, len(devices), device=devices[0], leaf_modules=leaf_modules
        )
    assert split_points is not None
    if isinstance(split_points, str):
        split_points = [split_points]
    devs = stage_devices(devices, len(split_points) + 1, "split_points make")
    split = FxSplit(module, list(split_points), devs, leaf_modules, why)
    first = split.first(sample)
    return Built(
        list(first.partitions),
        devs,
        list(first.balance),
        first.graph,
        root=module,
        split_points=list(split_points),
        split=split,
    )


def _auto_devices(
    how: str, devices: Sequence[DeviceLike] | None, sample: Any
) -> list[torch.device]:
    """The devices of a traced module's ``balance='time'|'size'``, checked
    before the module is profiled on the first of them."""
    if devices is None or sample is None:
        raise ValueError(
            f"balance={how!r} needs devices= (one per stage) and sample= (a "
            f"representative micro-batch: the module's inputs) to pick split points: it "
            f"profiles the module at construction, before any call; or give split_points= "
            f"(the first call is then the example a torch.export split needs)"
        )
    return _listed_devices(devices)


def _listed_devices(devices: Sequence[DeviceLike]) -> list[torch.device]:
    """``devices`` checked as one device per stage (their count is the
    stages'): a list, of devices this machine has."""
    return stage_devices(
        devices, len(devices) if isinstance(devices, Sized) else 0, "devices= gives"
    )


def _exported(
    module: nn.Module,
    split_points: Sequence[str] | None,
    balance: Sequence[int] | str | None,
    devices: Sequence[DeviceLike] | None,
    sample: Any,
    why: str,
    fx_error: BaseException | None,
) -> Built:
    """A module split by ``torch.export`` (see :mod:`~mpstream.stages.exported`)."""
    if any(isinstance(m, DeferredBatchNorm) for m in module.modules()):
        # Its statistics are summed in Python across a mini-batch's
        # micro-batches, which an exported graph would freeze.
        because = f"torch.fx could not trace it: {fx_error}" if fx_error else why
        raise ValueError(
            f"deferred_batch_norm=True: the module would be split by torch.export "
            f"({because}), which cannot run DeferredBatchNorm; use tracer='fx' or an "
            "nn.Sequential of stages, or leave deferred_batch_norm off"
        )
    if isinstance(balance, str) and split_points is None:
        devices = _auto_devices(balance, devices, sample)
        split_points = export_split_points(balance, module, sample, len(devices), devices[0])
    assert split_points is not None
    if isinstance(split_points, str):
        split_points = [split_points]
    devs = stage_devices(devices, len(split_points) + 1, "split_points make")
    split = ExportSplit(module, list(split_points), devs, why, fx_error)
    first = split.first(sample)
    if first is None:  # split at the first call, its arguments the example
        return Built([], devs, None, None, root=module, split_points=list(split_points),
                     split=split)  # fmt: skip
    return Built(
        list(first.stages.partitions),
        devs,
        list(first.balance),
        first.graph,
        root=module,
        split_points=list(split_points),
        split=split,
    )


def _auto_balance(
    module: nn.Module, how: str, devices: Sequence[DeviceLike] | None, sample: Any
) -> list[int]:
    if how not in ("time", "size"):
        raise ValueError(f"balance must be a list of ints, 'time' or 'size'; got {how!r}")
    if devices is None:
        raise ValueError(f"balance={how!r} needs devices= (one per stage) to know how many stages")
    if sample is None:
        raise ValueError(f"balance={how!r} needs sample= (a representative micro-batch) to profile")
    devs = _listed_devices(devices)  # before profiling on the first of them
    stages, layers = len(devs), sum(1 for _ in module.children())
    if stages > layers:
        raise ValueError(
            f"balance={how!r} gives each of the {stages} devices (devices=) a stage of at least "
            f"one layer, but the nn.Sequential has {layers} layer(s): give at most {layers} "
            f"devices"
        )
    if how == "time":
        return balance_by_time(module, sample, stages, device=devs[0])
    return balance_by_size(module, sample, stages, device=devs[0])

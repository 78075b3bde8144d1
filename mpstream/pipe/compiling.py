"""``torch.compile`` of pipeline stages.

``Pipe(..., compile=True)`` (or a dict of ``torch.compile`` keyword
arguments) compiles each stage's partition module. The compiled wrappers are
held by the pipe's runtime only, so the uncompiled layers stay registered and
``state_dict`` keys do not change (no ``_orig_mod.`` prefix); everything a
run's tasks do around a stage (copies, checkpointing, timing marks, profiler
ranges) stays outside the compiled call, so it adds no graph break inside a
stage.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

__all__ = ["CompileOption", "compile_options", "compile_stages"]

# What Pipe's compile= accepts.
CompileOption = bool | Mapping[str, Any] | None

# Every stage is an nn.Sequential, so every stage compiles the same code
# object; where torch allows it, each stage keeps its own recompile budget
# instead of sharing one (8 by default) with all the others.
_ISOLATE = "isolate_recompiles" in inspect.signature(torch.compile).parameters


def compile_options(option: CompileOption) -> dict[str, Any] | None:
    """Validates ``compile=``: None when off, else ``torch.compile``'s kwargs.

    The options are tried on a throwaway module, so a bad keyword, mode or
    backend fails at construction rather than at the first forward.

    Raises:
        TypeError: ``option`` is neither a bool nor a mapping with str keys,
            or ``torch.compile`` rejects a keyword.
        RuntimeError: ``torch.compile`` rejects a value (an unknown mode or
            backend: torch raises its own error types for those).
    """
    if option is None or option is False:
        return None
    if option is True:
        kwargs: dict[str, Any] = {}
    elif isinstance(option, Mapping) and all(isinstance(k, str) for k in option):
        kwargs = dict(option)
    else:
        raise TypeError(
            f"compile must be a bool or a dict of torch.compile keyword arguments; "
            f"got {type(option).__name__}"
        )
    if _ISOLATE:
        kwargs.setdefault("isolate_recompiles", True)
    torch.compile(nn.Identity(), **kwargs)
    return kwargs


def compile_stages(
    partitions: Sequence[nn.Module], options: dict[str, Any] | None
) -> list[nn.Module]:
    """The modules a run calls: each partition, compiled if ``options``.

    Args:
        partitions: one module per stage.
        options: ``torch.compile`` keyword arguments, or None for eager.

    Returns:
        The partitions themselves, or ``torch.compile`` wrappers around them.
    """
    if options is None:
        return list(partitions)
    return [cast(nn.Module, torch.compile(p, **options)) for p in partitions]

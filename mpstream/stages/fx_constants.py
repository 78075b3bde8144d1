"""The tensors ``torch.fx`` computes while tracing and stores on the module
as constants, under a fresh name per trace: two traces' stages compared as
code up to those names (and the constants' values), and a trace not kept
cleared of its own (:mod:`~mpstream.stages.traced` keeps one split for
kinds of call whose traces compute the same).
"""

from __future__ import annotations

import re

import torch
from torch import fx, nn

from .fx import Traced

__all__ = ["same_code", "drop_constants"]

# What fx names a tensor it computed while tracing (a fresh name per trace).
_CONSTANT = re.compile(r"_attr__tensor_constant\d+")


def same_code(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    """Whether two stages run the same code on equal constants."""
    names_a, names_b = (list(dict.fromkeys(_CONSTANT.findall(p.code))) for p in (a, b))
    if len(names_a) != len(names_b):
        return False
    code_a, code_b = a.code, b.code
    for i, (x, y) in enumerate(zip(names_a, names_b)):
        code_a = re.sub(rf"\b{x}\b", f"_constant{i}_", code_a)
        code_b = re.sub(rf"\b{y}\b", f"_constant{i}_", code_b)
        s, t = getattr(a, x), getattr(b, y)
        if s.dtype != t.dtype or s.shape != t.shape or s.device != t.device:
            return False
        if not torch.equal(s, t):
            return False
    return code_a == code_b


def drop_constants(module: nn.Module, traced: Traced) -> None:
    """Removes from ``module`` the constants fx put there for a trace that
    is not kept (each trace adds its own)."""
    for part in traced.partitions:
        for target in getattr(part, "_mpstream_attrs", {}).values():
            if _CONSTANT.fullmatch("_attr_" + target) and hasattr(module, target):
                delattr(module, target)

"""What a stage is to the runtime, and how the hot loop calls it.

A Sequential pipeline's stages are :class:`Chain` modules: their layers one
after the other, spreading a tuple into the arguments of a layer that takes
several. Any other stage (a traced partition, a user's module) is called as
it is. :class:`StageCalls` picks, per run, the callable a task invokes for
each stage, sparing a module call where that changes nothing.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .._warn import warn

__all__ = ["Chain", "StageCalls", "spread_is_unsure", "takes_several"]


def _positional(module: nn.Module) -> tuple[list[inspect.Parameter], bool] | None:
    """``module.forward``'s positional parameters, and whether it takes
    ``*args``; None for a builtin without a signature."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    return [p for p in params if p.kind in kinds], varargs


def takes_several(module: nn.Module) -> bool:
    """Whether ``module.forward`` takes more than one positional argument."""
    found = _positional(module)
    return found is not None and (found[1] or len(found[0]) > 1)


def spread_is_unsure(module: nn.Module) -> bool:
    """Whether a tuple spread into ``module.forward`` may not be what its
    author meant: one required positional parameter (or none) and optional
    ones after it, so ``nn.Sequential`` would pass the tuple whole and
    torch's Pipe spread it. torch's own modules (``nn.LSTM``'s ``hx``,
    ``nn.TransformerEncoderLayer``'s masks) take no tuple as their first
    argument: spread, surely."""
    found = _positional(module)
    if found is None or found[1] or type(module).__module__.startswith("torch."):
        return False
    positional = found[0]
    required = sum(p.default is inspect.Parameter.empty for p in positional)
    return len(positional) > 1 and required <= 1


class Chain(nn.Sequential):
    """A stage of a Sequential pipeline: its layers one after the other.

    Unlike ``nn.Sequential``, it takes several inputs, and a tuple reaching
    a layer whose ``forward`` takes several arguments is spread into them
    (the removed ``torch.distributed.pipeline.sync.Pipe``'s convention); a
    layer taking one gets the tuple whole (``nn.Sequential``'s and
    torchgpipe's). Where the two conventions disagree (a layer taking one
    required positional argument and optional ones, ``spread_is_unsure``),
    the tuple is spread and the first call that spreads one says so, once
    per layer: ``nn.Sequential`` would have passed it whole.

    Its layers are fixed once built: the pipe registers the same layer
    objects as its own (its ``state_dict``, its ``parameters()`` for the
    optimizer), so a layer put into a stage would run without being part
    of the pipe. Replacing, adding or removing one raises.
    """

    def __init__(self, layers: OrderedDict[str, nn.Module]) -> None:
        super().__init__(layers)
        self._spread = [takes_several(layer) for layer in self]
        # Layers to warn about at their first spread tuple (then forgotten).
        self._unsure = {i for i, layer in enumerate(self) if spread_is_unsure(layer)}

    def _refuse(self, name: str) -> None:
        if "_spread" in self.__dict__:  # built
            raise TypeError(
                f"a Pipe's stage runs the layers it was built with, which the Pipe holds as "
                f"its own: layer '{name}' cannot be replaced, added or removed. Change the "
                f"layer in place (its parameters, load_state_dict, its own submodules), or "
                f"build a new Pipe around the changed model"
            )

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, nn.Module) or name in self._modules:
            self._refuse(name)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in self._modules:
            self._refuse(name)
        super().__delattr__(name)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        self._refuse(name)
        super().add_module(name, module)

    def insert(self, index: int, module: nn.Module) -> Chain:
        self._refuse(str(index))
        return super().insert(index, module)  # type: ignore[return-value]

    def forward(self, *args: Any) -> Any:  # type: ignore[override]
        if not any(self._spread):  # every layer takes one value: nn.Sequential's loop
            x = args[0] if len(args) == 1 else args
            for layer in self:
                x = layer(x)
            return x
        unsure = self.__dict__.get("_unsure")  # absent from a Chain pickled before it
        for i, (layer, spread) in enumerate(zip(self, self._spread)):
            if spread and len(args) == 1 and isinstance(args[0], tuple):
                args = args[0]
            elif not spread and len(args) > 1:
                args = (args,)
            if unsure and len(args) > 1 and i in unsure:
                unsure.discard(i)
                _say_spread(list(self._modules)[i], layer, len(args))
            args = (layer(*args),)
        return args[0]


def _say_spread(name: str, layer: nn.Module, values: int) -> None:
    """Warns that ``values`` values were spread into ``layer``, where
    ``nn.Sequential`` would have passed them whole, as a tuple."""
    signature = inspect.signature(layer.forward)
    first = next(iter(signature.parameters))
    warn(
        f"mpstream: layer '{name}' ({type(layer).__name__}) gets a tuple of {values} values "
        f"spread into forward{signature}, as torch's Pipe spread tuples; nn.Sequential and "
        f"torchgpipe would pass the tuple whole as '{first}'. If the layer expects the tuple "
        f"whole, make the parameters after '{first}' keyword-only (forward(self, {first}, *, "
        f"...)); if it expects the values, give them no defaults, and this warning goes. "
        f"(Warned once per layer.)",
        UserWarning,
    )


class StageCalls:
    """What the hot loop calls for each stage of a run.

    A :class:`Chain` holding one layer that takes its one argument whole
    computes ``layer(x)``; the layer is called directly, sparing a module
    call per task (a pipe of one block per stage is the common case, the
    tutorial's among them), unless that would skip something the chain's
    own call does: its hooks, hooks registered for every module, or a
    ``forward`` replaced on the instance. Every other stage is called as it
    is.

    Args:
        parts: one module per stage.
    """

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        self.parts = list(parts)
        # The name of the one layer of each plain one-layer Chain (a subclass
        # may call its layers differently: not those), else None.
        self.direct: list[str | None] = []
        for part in self.parts:
            name = None
            if isinstance(part, Chain) and type(part) is Chain and len(part) == 1:
                name = None if part._spread[0] else next(iter(part._modules))
            self.direct.append(name)

    def __call__(self, inputs: int) -> list[nn.Module]:
        """The callables of a run whose first stage receives ``inputs``
        positional values (the others of a chain receive one)."""
        hooks = torch.nn.modules.module  # hooks for every module: what _call_impl checks
        any_global = bool(
            hooks._global_forward_hooks
            or hooks._global_forward_pre_hooks
            or hooks._global_backward_hooks
            or hooks._global_backward_pre_hooks
        )
        calls = []
        for s, (part, name) in enumerate(zip(self.parts, self.direct)):
            layer = None if name is None else part._modules.get(name)
            keep = (
                any_global
                or (s == 0 and inputs != 1)
                or "forward" in part.__dict__
                or part._forward_hooks
                or part._forward_pre_hooks
                or part._backward_hooks
                or part._backward_pre_hooks
            )
            calls.append(part if layer is None or keep else layer)
        return calls

"""The ``nn.Module`` side of a Pipe: its layers, placement and copies.

:class:`~mpstream.Pipe` registers the wrapped module's layers (a traced
module's own children and tensors, adopted so ``state_dict`` keys stay the
module's), keeps the stages' references to them current across dtype
conversions and ``load_state_dict``, refuses device moves (stages are placed
at construction), gives Sequential-like access to its layers and drops its
streams and C++ scheduler when pickled or copied. :class:`PipeModule` holds
that, so ``pipe.py`` and ``call.py`` hold only what runs the pipeline.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..stages.placement import rebind

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

__all__ = ["PipeModule"]


class PipeModule(nn.Module):
    """Base of :class:`~mpstream.Pipe`: layers, fixed placement, pickling.

    Expects ``_partitions`` (one module per stage), ``_root`` (the traced
    module, or None for a Sequential) and ``_runtime`` in ``__dict__``.
    """

    @property
    def partitions(self) -> nn.ModuleList:
        """One ``nn.Sequential`` per stage."""
        return self.__dict__["_partitions"]  # type: ignore[no-any-return]

    # -- a traced module's layers and tensors ---------------------------
    def _adopt_module(self, module: nn.Module | None) -> None:
        """Registers a traced module's own children and tensors on the pipe,
        so its state_dict keys are the module's."""
        assert module is not None
        for name, child in module.named_children():
            self._adopt(name, child, self.add_module)
        for name, param in module._parameters.items():
            self._adopt(name, param, self.register_parameter)
        for name, buf in module._buffers.items():
            keep = name not in module._non_persistent_buffers_set
            self._adopt(name, buf, functools.partial(self.register_buffer, persistent=keep))
        self.register_load_state_dict_post_hook(_rebind_after_load)  # type: ignore[no-untyped-call]

    def _adopt(self, name: str, value: Any, register: Callable[[str, Any], None]) -> None:
        if name in self.__dict__ or hasattr(type(self), name):
            raise ValueError(
                f"the module's attribute '{name}' clashes with Pipe's own '{name}'; rename it"
            )
        register(name, value)

    def _rebind(self) -> None:
        """Points the stages' own references at the module's current tensors."""
        root = self.__dict__.get("_root")
        if root is None:
            return
        for name, param in self._parameters.items():
            root._parameters[name] = param
        for name, buf in self._buffers.items():
            root._buffers[name] = buf
        for part in self.partitions:
            rebind(part, root)  # type: ignore[arg-type]

    def _apply(self, fn: Any, recurse: bool = True) -> Self:  # type: ignore[override]
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        self._rebind()
        return self

    # -- Sequential-like access -----------------------------------------
    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(m for m in self._modules.values() if m is not None)

    def __getitem__(self, index: int | slice) -> nn.Module:
        layers = [m for m in self._modules.values() if m is not None]
        if isinstance(index, slice):
            return nn.Sequential(*layers[index])
        return layers[index]

    # -- placement is fixed ----------------------------------------------
    def cuda(self, device: Any = None) -> Self:
        raise TypeError("Pipe's stages are placed at construction; .cuda() would move them all")

    def cpu(self) -> Self:
        raise TypeError("Pipe's stages are placed at construction; .cpu() would move them all")

    def to(self, *args: Any, **kwargs: Any) -> Self:  # type: ignore[override]
        """Converts dtype (``.to(torch.half)``); device moves raise ``TypeError``."""
        device, _, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            raise TypeError(
                "Pipe's stages are placed at construction; .to(device) would move them all "
                "(use .to(dtype) to convert)"
            )
        return super().to(*args, **kwargs)

    # -- pickling / deepcopy: streams and the C++ scheduler are rebuilt -----
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_runtime"] = None
        return state


def _rebind_after_load(pipe: nn.Module, keys: Any) -> None:
    pipe._rebind()  # type: ignore[operator]

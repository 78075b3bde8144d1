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

from ..runtime import private
from ..stages.fx import Traced
from ..stages.placement import check_parametrized, rebind
from ..stages.traced import FxSplit
from ..stages.tracers import Binder

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

__all__ = ["PipeModule", "unsplit"]

# Why a device move is refused, whether the stages were split at construction
# or are split at the first call.
_FIXED = "A Pipe's stage devices are fixed when it is built (devices=)"

# The caches of the pipe's BatchNorm buffers and stage parameters that a
# training step's failure snapshot saves (see PipeStep).
_TENSOR_LISTS = ("_norm_buffers", "_param_lists")


def unsplit(what: str) -> RuntimeError:
    """The error for ``what`` asked of a pipe not split yet (a module split
    by ``torch.export`` without ``sample=`` is split at its first call)."""
    return RuntimeError(
        f"{what} needs the pipe's stages, and this pipe is not split yet: torch.export "
        f"splits its module at the first call, whose arguments are the example. Call the "
        f"pipe once (or pass sample=, an example call, to Pipe) first"
    )


class PipeModule(nn.Module):
    """Base of :class:`~mpstream.Pipe`: layers, fixed placement, pickling.

    Expects ``_partitions`` (one module per stage; none until a module
    exported at its first call is split), ``_graph`` (None until then),
    ``_root`` (the traced module, or None for a Sequential) and
    ``_runtime`` in ``__dict__``.
    """

    @property
    def partitions(self) -> nn.ModuleList:
        """One module per stage (an ``nn.Sequential``, or a traced split's
        ``GraphModule``).

        Raises:
            RuntimeError: the pipe is not split yet (call it once first).
        """
        if self.__dict__["_graph"] is None:
            raise unsplit("pipe.partitions")
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
        # Only the module's own: a tensor the user added to the pipe stays off it.
        held = self.__dict__.get("_sealed", ())
        for name, param in self._parameters.items():
            if name in held:
                root._parameters[name] = param
        for name, buf in self._buffers.items():
            if name in held:
                root._buffers[name] = buf
        for part in self.__dict__["_partitions"]:  # none before a first-call split
            rebind(part, root)

    def _apply(self, fn: Any, recurse: bool = True) -> Self:  # type: ignore[override]
        # Reached by a holder's .to()/.cuda() (or .to_empty() to another
        # device): a device move would put every stage on one device, so it
        # is refused before any of the Pipe's tensors moves (a probe tensor
        # per stage device shows what fn does). The holder's parts that
        # came before the Pipe have moved already: nothing here can stop that.
        for device in dict.fromkeys(self.__dict__.get("_devices") or ()):
            try:
                moved = fn(torch.empty(0, device=device)).device
            except Exception:
                continue  # fn itself will say what is wrong
            if moved != device:
                raise TypeError(
                    f"{_FIXED}; moving the Pipe (or a module holding it) would move the "
                    f"stages on {device} to {moved}. The Pipe stays where it is (a holder's "
                    f"parts before it have moved): move the holder's other parts alone, or "
                    f"convert dtypes only (.to(dtype))"
                )
        # Refused before the conversion, not by the rebinding after it: the
        # Pipe's tensors stay as they were.
        root = self.__dict__.get("_root")
        if root is not None:
            for part in self.__dict__.get("_partitions") or ():
                check_parametrized(part, root)
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        # A conversion puts new tensors in place of the buffers (and, with
        # torch.__future__'s overwrite flag, of the parameters) without
        # registering them: the failure snapshot's lists would keep the old.
        for cache in _TENSOR_LISTS:
            self.__dict__.pop(cache, None)
        self._rebind()
        return self

    # -- the stages hold the layers themselves ----------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        described = getattr(type(self), name, None)
        if isinstance(described, property) and described.fset is None:
            # Python's own "has no setter" says nothing of what to do instead.
            raise AttributeError(
                f"pipe.{name} is fixed when the Pipe is built (the module is split and "
                f"placed then): for another, build a new Pipe; the old one's state_dict() "
                f"loads into it (its keys are the module's)"
            )
        replacing = self._replacing(name, value, "_modules", "_parameters", "_buffers")
        super().__setattr__(name, value)
        if replacing:
            self._rebind()

    def __delattr__(self, name: str) -> None:
        if self._held(name, "_modules", "_parameters", "_buffers"):
            raise TypeError(
                f"the Pipe's stages read '{name}'; it cannot be deleted (replace it instead, "
                f"or build a new Pipe around the changed module)"
            )
        super().__delattr__(name)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        self._replacing(name, module, "_modules")  # refused: raises
        super().add_module(name, module)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        replacing = self._replacing(name, param, "_parameters")
        super().register_parameter(name, param)
        if replacing:
            self._rebind()

    def register_buffer(
        self, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None:
        replacing = self._replacing(name, tensor, "_buffers")
        super().register_buffer(name, tensor, persistent)
        if replacing:
            self._rebind()

    def _seal(self) -> None:
        """Ends construction: the layers and tensors registered so far are
        the stages'; one registered later is the user's own, set and
        deleted freely."""
        self.__dict__["_sealed"] = _names(self.__dict__)

    def _held(self, name: str, *kinds: str) -> bool:
        """Whether, after construction, ``name`` is one of the pipe's layers
        or tensors of ``kinds`` (``_modules``, ``_parameters``, ``_buffers``),
        which the stages hold. (Read from ``__dict__``: nn.Module's own
        ``__init__`` sets attributes before those exist.)"""
        state = self.__dict__
        return name in state.get("_sealed", ()) and any(name in state[k] for k in kinds)

    def _replacing(self, name: str, value: Any, *kinds: str) -> bool:
        """Whether setting ``name`` replaces what the stages hold, once
        :meth:`_replace` has checked the new ``value``."""
        if not self._held(name, *kinds):
            return False
        self._replace(name, value)
        return True

    def _replace(self, name: str, value: Any) -> None:
        """Checks a replacement of the pipe's layer or tensor ``name``: the
        stages hold the layers themselves (a new one would not run), and read
        a tensor on its stage's device.

        Raises:
            TypeError: a layer replaced, or a tensor replaced by something else.
            ValueError: a tensor replaced by one on another device.
        """
        if name in self._modules:
            raise TypeError(
                f"Pipe's stages were split at construction and run the layer '{name}' they "
                f"hold: a new one would not run. Change the layer in place (its parameters, "
                f"load_state_dict), or build a new Pipe around the changed module"
            )
        old = getattr(self, name)
        if name in self._buffers and isinstance(value, nn.Parameter):
            raise TypeError(f"'{name}' is a buffer the stages read; replace it with a buffer")
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"'{name}' is a tensor the stages read; replace it with a tensor, not "
                f"{type(value).__name__}"
            )
        if old is not None and value.device != old.device:
            raise ValueError(
                f"'{name}' sits on {old.device}, where the stage reading it runs; the new "
                f"tensor is on {value.device}: move it there first"
            )

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

    def __setitem__(self, index: int, layer: nn.Module) -> None:
        # nn.Sequential's spelling of a replacement: refused as the
        # attribute's (the stages hold the layers themselves).
        self._replace(self._layer_name(index), layer)

    def __delitem__(self, index: int | slice) -> None:
        raise TypeError(
            "the Pipe's stages read its layers: none can be deleted (build a new Pipe around "
            "the changed module)"
        )

    def _layer_name(self, index: int) -> str:
        """The name of the pipe's layer at ``index`` (negative counts from the end)."""
        names = [n for n, m in self._modules.items() if m is not None]
        return names[index]

    # -- placement is fixed ----------------------------------------------
    def _stays(self, device: Any) -> bool:
        """Whether every stage already sits on ``device`` (a move to it is
        no move: generic code calling ``model.to(device)`` keeps working)."""
        target = torch.device(device)
        if target.type == "cuda" and target.index is None and torch.cuda.is_available():
            target = torch.device("cuda", torch.cuda.current_device())
        return all(d == target for d in self.__dict__["_devices"])

    def cuda(self, device: Any = None) -> Self:
        index = torch.device(device).index if isinstance(device, (str, torch.device)) else device
        if self._stays("cuda" if index is None else torch.device("cuda", index)):
            return self
        raise TypeError(f"{_FIXED}; .cuda() would move them all")

    def cpu(self) -> Self:
        if self._stays("cpu"):
            return self
        raise TypeError(f"{_FIXED}; .cpu() would move them all")

    def to(self, *args: Any, **kwargs: Any) -> Self:  # type: ignore[override]
        """Converts dtype (``.to(torch.half)``); device moves raise ``TypeError``
        (a "move" to where every stage already is changes nothing)."""
        device, _, _, _ = private.parse_to(*args, **kwargs)
        if device is not None and not self._stays(device):
            raise TypeError(
                f"{_FIXED}; .to(device) would move them all (use .to(dtype) to convert)"
            )
        return super().to(*args, **kwargs)

    # -- pickling / deepcopy: streams and the C++ scheduler are rebuilt -----
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_runtime"] = None
        for cache in ("_scheduler", "_busy", *_TENSOR_LISTS):  # rebuilt on use
            state.pop(cache, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in ("virtual_stages", "force_copies"):
            if name in state:  # pickled while it was a plain attribute
                state[f"_{name}"] = state.pop(name)
        if state.get("_sealed") is True:  # pickled while it was a flag
            state["_sealed"] = _names(state)
        bind = state.pop("_bind", None)
        if isinstance(bind, Binder) and state.get("_split") is None:
            # Pickled before torch.fx pipes traced per kind of call: its one
            # trace becomes the first kind (see FxSplit.adopt).
            parts = list(state["_partitions"])
            traced = Traced(parts, state["_graph"], bind, [set() for _ in parts])
            state["_root"].training = state["training"]  # Pipe.train() did not set it then
            state["_split"] = FxSplit.adopt(
                state["_root"], list(state["_split_points"]), list(state["_devices"]), traced
            )
        super().__setstate__(state)  # type: ignore[no-untyped-call]


def _names(state: dict[str, Any]) -> frozenset[str]:
    """The names of the layers and tensors registered in a module's ``__dict__``."""
    return frozenset[str]().union(state["_modules"], state["_parameters"], state["_buffers"])


def _rebind_after_load(pipe: nn.Module, keys: Any) -> None:
    pipe._rebind()  # type: ignore[operator]

"""What a stage's graphs bake in, and how a run notices that it changed.

A replay reads the tensors and settings its capture saw. :class:`Baked` is
what a stage held then, checked once per run for what the graphs cannot
follow: a module, parameter or buffer replaced (module registration hooks
bump :func:`generation`, so the stage is walked again only then, and a
registration elsewhere changes nothing), a tensor
moved to other memory or laid out anew (``.data = ...``, ``.to()``,
``.t_()``: one C++ pass over the stage's tensors, ``mpstream._C.Watch``), or
``requires_grad`` switched. In-place updates (any optimizer's step) are what
graphs are for and go unnoticed. :func:`signature` and :func:`autocast_key`
are what a call passed and ran under: parts of the key its graphs are found
by, with :class:`Scalars` bounding how many values a plain argument may take.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ... import _ext
from .. import private
from ..microbatch import FLAT, leaves

__all__ = [
    "Baked", "Scalars", "any_autocast", "autocast_key", "generation", "hooks_registered",
    "signature", "MAX_VALUES",
]  # fmt: skip

#: Values one plain argument of a stage may take before further values run
#: eagerly (each value is baked into graphs of its own).
MAX_VALUES = 8

_generation = 0
_hooked = False
_training = operator.attrgetter("training")
#: Whether autocast is on for any device (see private.autocast_check): one
#: call to torch, which spares a replayed task :func:`autocast_key` when no.
any_autocast = private.autocast_check()
#: torch modules whose forward reads no training flag (exact types: a
#: subclass may read it). Their flag changes nothing a graph computes, so a
#: run does not read it: most of a transformer's modules are of these.
_MODELESS: frozenset[type[nn.Module]] = frozenset(
    {
        nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Identity, nn.Flatten, nn.Unflatten,
        nn.Linear, nn.Bilinear, nn.Embedding,
        nn.Conv1d, nn.Conv2d, nn.Conv3d,
        nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
        nn.LayerNorm, nn.GroupNorm, nn.RMSNorm,
        nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Softmax, nn.LeakyReLU,
        nn.Mish, nn.Hardswish,
        nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d,
        nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
    }
)  # fmt: skip


def _bump(*_: object) -> None:
    global _generation
    _generation += 1


def hooks_registered() -> int:
    """A counter that grows whenever any hook is registered through torch's
    API (a tensor's ``register_hook`` or ``register_post_accumulate_grad_hook``,
    a module's hooks): each makes a ``RemovableHandle``, which takes the next
    id. Unchanged, no parameter gained a hook since it was read: a scan of
    every parameter's hooks, once per run and stage, is skipped then."""
    return RemovableHandle.next_id


def generation() -> int:
    """A counter bumped whenever any module registers a parameter, buffer or
    submodule (assignment included) from the first :class:`Baked` on."""
    global _hooked
    if not _hooked:
        _hooked = True
        hooks = torch.nn.modules.module
        hooks.register_module_parameter_registration_hook(_bump)
        hooks.register_module_buffer_registration_hook(_bump)
        hooks.register_module_module_registration_hook(_bump)
    return _generation


class Baked:
    """What one stage's graphs baked in (its modules and tensors), checked per run.

    Args:
        stage: the stage's module.

    Attributes:
        params: the parameters that require grad, each once (tied ones too).
    """

    def __init__(self, stage: nn.Module) -> None:
        self.stage = stage
        self.seen = generation()
        self.modules = list(stage.modules())
        self.tensors = [*stage.parameters(), *stage.buffers()]
        self.params = [p for p in stage.parameters() if p.requires_grad]
        self.watch = _ext.load().Watch(self.tensors)
        # The modules whose flag a run reads (see modes): a replaced module
        # makes a new Baked, so the list lives as long as the modules do.
        self.moded = [m for m in self.modules if _moded(m)]

    def changed(self) -> bool:
        """Whether a module, parameter or buffer was replaced, or a tensor
        moved, laid out anew or switched ``requires_grad``, since capture.

        A registration anywhere (a module built elsewhere, a metric) walks
        the stage once to see whether it was this stage's: only then are
        its graphs, and its gradient buffers, replaced."""
        now = generation()
        if now != self.seen:
            tensors = [*self.stage.parameters(), *self.stage.buffers()]
            if not (
                _same(self.modules, list(self.stage.modules())) and _same(self.tensors, tensors)
            ):
                return True
            self.seen = now
        return bool(self.watch.changed())

    def modes(self) -> tuple[bool, ...]:
        """The training flag of every module that may read it (part of each
        call's key): modules of :data:`_MODELESS`'s types are left out unless
        they have hooks (a hook may read it)."""
        return tuple(map(_training, self.moded))

    def hooked(self) -> str | None:
        """The name of a parameter with a tensor hook (``register_hook``),
        which a replay cannot run where eager autograd would."""
        for name, p in self.stage.named_parameters():
            if p._backward_hooks:
                return name
        return None


def _moded(module: nn.Module) -> bool:
    """Whether ``module``'s training flag may change what it computes."""
    hooked = (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    )
    return bool(hooked) or type(module) not in _MODELESS


def _same(a: Sequence[object], b: Sequence[object]) -> bool:
    """The same objects, in the same order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def autocast_key() -> tuple[Any, ...]:
    """The autocast state a capture bakes in: (device type, dtype) of each enabled one."""
    if not any_autocast():
        return ()  # the common case (StageGraphs.find asks any_autocast itself first)
    return tuple(
        (d, torch.get_autocast_dtype(d)) for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)
    )


def signature(args: Sequence[Any], grads: Sequence[bool] | None = None) -> tuple[Any, ...] | None:
    """A call's arguments as a key: per tensor its dtype, shape, strides,
    device and whether it needs a gradient (``grads``, one per tensor, else
    its own ``requires_grad``), plain values as they are; None when a plain
    value cannot be a key (it is not hashable). Storage offsets are left
    out: inputs are copied into the graphs' own buffers."""
    if grads is None or len(grads) == len(args):
        # The common case, once per replayed forward: a flat sequence of
        # tensors keyed as below without copying it or walking it twice.
        flat: list[Any] = [(FLAT, len(args))]
        for i, x in enumerate(args):
            if type(x) is not Tensor:
                break
            need = x.requires_grad if grads is None else grads[i]
            flat.append((x.dtype, x.shape, x.stride(), x.device, need))
        else:
            return tuple(flat)
    items, spec = leaves(tuple(args))
    key: list[Any] = [spec]  # None, a flat tuple's marker, or a (hashable) TreeSpec
    k = 0
    for x in items:
        if isinstance(x, Tensor):
            need = x.requires_grad if grads is None else grads[k]
            k += 1
            key.append((x.dtype, x.shape, x.stride(), x.device, need))
        else:
            try:
                hash(x)
            except TypeError:
                return None
            key.append((type(x), x))
    return tuple(key)


class Scalars:
    """The values each plain argument of one stage took, bounded.

    A float that changes at every step (a temperature, a schedule's scale)
    would capture new graphs at every value: past :data:`MAX_VALUES`
    distinct values at one position, new values run eagerly and
    :meth:`admit` says which argument once.
    """

    def __init__(self) -> None:
        self.seen: dict[int, set[Any]] = {}
        self.warned = False

    def admit(self, sig: tuple[Any, ...]) -> str | None:
        """Notes the plain values of a call's signature; returns why it must
        run eagerly (a value beyond the bound), or None."""
        for i, item in enumerate(sig[1:]):
            if len(item) != 2 or not isinstance(item[0], type):
                continue  # a tensor's entry
            kind, value = item
            if kind in (bool, type(None)):
                continue
            values = self.seen.setdefault(i, set())
            if value in values:
                continue
            if len(values) >= MAX_VALUES:
                return (
                    f"argument {i} (a {kind.__name__}) took more than {MAX_VALUES} values, each "
                    f"captured in graphs of its own; pass it as a tensor (a 0-dim one on the "
                    f"stage's device) to replay one graph for all values"
                )
            values.add(value)
        return None

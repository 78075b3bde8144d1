"""Module hooks a pipe's stages would not run: refused, naming the module.

A stage runs the layers a Sequential's partition holds, and the submodules
``torch.fx`` calls whole (its leaves), as modules: their hooks run at every
call, as in the plain model. The code of every other module a trace
enters (the traced module, and each submodule the forward calls that
``torch.fx`` traces through; for ``torch.export``, each it calls) becomes
the stages' own code when it is traced: a hook present then would run
once, on the trace's stand-ins, its effect fixed into the stages (still
there after ``handle.remove()``), and one registered later would never
run. A full backward hook there would not see the gradients it is meant
to. So each module a trace enters is checked as it enters it, before its
hooks run (see :func:`entering`), and again at every call the trace
serves, and one holding a hook is refused
(Hugging Face transformers' own output-capturing hooks aside, and the
hooks of torch.nn.utils' ``spectral_norm``, hook-based ``weight_norm``
and ``prune``, and torch.ao.quantization's observer hooks, on a submodule:
tensor code a trace holds as the module's, run at every call). A module
the traced forward never calls runs none of its hooks in the plain model
either: its hooks are left alone.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.modules.module import register_module_forward_pre_hook

__all__ = [
    "HookError",
    "check_root_hooks",
    "check_traced_hooks",
    "check_unsized",
    "entering",
    "name_in",
    "recomputed_attribute",
]


class HookError(TypeError):
    """A hook refused on a module a trace entered: its own class so that a
    split does not keep the refusal as its kind of call's (the call works
    once the hook is removed)."""


# A module's hook dicts, and how a message names each kind.
_KINDS = (
    ("_forward_pre_hooks", "forward pre-hook (register_forward_pre_hook)"),
    ("_forward_hooks", "forward hook (register_forward_hook)"),
    ("_backward_pre_hooks", "backward pre-hook (register_full_backward_pre_hook)"),
    ("_backward_hooks", "backward hook (register_full_backward_hook)"),
)


def name_in(root: nn.Module, module: nn.Module) -> str:
    """``module``'s qualified name in ``root`` (``"?"`` if it has none), for
    a message: only looked up once something is refused."""
    return next((n for n, m in root.named_modules() if m is module), "?")


def _transformers_own(hook: object) -> bool:
    """Whether Hugging Face transformers installed ``hook`` itself.

    transformers keeps forward hooks on a model's layers once a call asks
    for hidden states or attentions (its output capturing): they record
    only while such a call runs, so a trace of that kind of call holds what
    they record (see :mod:`~mpstream.stages.hf`), as the model's own code.
    """
    module = getattr(hook, "__module__", None) or ""
    return module == "transformers" or module.startswith("transformers.")


def recomputed_attribute(hook: object) -> str | None:
    """The attribute ``hook`` sets before each forward if it is one of
    torch.nn.utils' weight reparametrizations by hook (``spectral_norm``,
    the hook-based ``weight_norm``, ``prune``), else None. Such a hook
    computes the weight from the module's parameters and buffers (and, for
    spectral_norm in training, updates buffers): tensor code only, which a
    trace holds as the module's own code, run at every call."""
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    if isinstance(hook, (SpectralNorm, WeightNorm)):
        return hook.name
    if isinstance(hook, BasePruningMethod):
        return hook._tensor_name  # type: ignore[no-any-return]
    return None


def _recomputing(hook: object) -> bool:
    return recomputed_attribute(hook) is not None or _observing(hook)


def _observing(hook: object) -> bool:
    """Whether ``hook`` is one of the observer hooks torch.ao.quantization's
    ``prepare`` and ``prepare_qat`` register (eager-mode quantization): it
    calls the module's ``activation_post_process`` submodule (an observer
    or a fake quantization), module code a trace follows or calls as it
    does the model's, at every call."""
    # The module (torch.ao.quantization's ``quantize`` name is a function).
    quantize = importlib.import_module("torch.ao.quantization.quantize")
    return any(
        hook is getattr(quantize, name, None)
        for name in ("_observer_forward_hook", "_observer_forward_pre_hook")
    )


def _hook_kind(module: nn.Module, traced: bool = False) -> str | None:
    """The kind of the first hook ``module`` holds (not transformers' own,
    nor, where a trace follows the module's code, a recomputing norm's),
    or None."""
    for attribute, kind in _KINDS:
        hooks = getattr(module, attribute, None)
        if hooks and not all(
            _transformers_own(h) or (traced and _recomputing(h)) for h in hooks.values()
        ):
            return kind
    return None


# The module given to Pipe is not the pipe: its state_dict hooks would not
# run either (the pipe's state_dict() and load_state_dict() are its own).
_STATE_KINDS = (
    ("_state_dict_pre_hooks", "state_dict pre-hook (register_state_dict_pre_hook)"),
    ("_state_dict_hooks", "state_dict hook (register_state_dict_post_hook)"),
    ("_load_state_dict_pre_hooks", "load_state_dict pre-hook (register_load_state_dict_pre_hook)"),
    ("_load_state_dict_post_hooks", "load_state_dict hook (register_load_state_dict_post_hook)"),
)


def _root_error(module: nn.Module, kind: str) -> HookError:
    method = kind[kind.index("(") + 1 : -1]
    return HookError(
        f"the {type(module).__name__} given to Pipe has a {kind} of its own, which the pipe "
        f"would not run: a Pipe is a module of its own, holding the module's layers and "
        f"running its stages, not the module itself. Remove it and register it on the Pipe "
        f"instead (pipe.{method}(...))"
    )


def check_root_hooks(module: nn.Module) -> None:
    """Refuses a module whose own hooks a Pipe over it would not run.

    Args:
        module: the module given to ``Pipe``.

    Raises:
        TypeError: ``module`` holds a forward, forward pre-, backward or
            backward pre-hook, or a ``state_dict`` or ``load_state_dict``
            hook, naming it and saying to register it on the Pipe.
    """
    kind = _hook_kind(module)
    if kind is None:
        kind = next((kind for attribute, kind in _STATE_KINDS if getattr(module, attribute)), None)
    if kind is not None:
        raise _root_error(module, kind)


@contextmanager
def entering(root: nn.Module, tracer: str) -> Iterator[list[nn.Module]]:
    """Records the modules of ``root`` a trace enters while the block runs,
    refusing a hook on one as it enters it, before the hook runs.

    A call that the trace follows runs the module's ``__call__``, hooks
    included; one that ``torch.fx`` records whole (a leaf) does not. The
    graph's ``nn_module_stack`` would miss a module that adds no operation
    of its own (``nn.Identity``, a dropout in eval), whose hooks the plain
    model runs all the same.

    Args:
        root: the traced module (entered, though ``torch.fx`` calls its
            ``forward`` directly); its hooks are checked before the block.
        tracer: ``"fx"`` or ``"export"``, for the advice.

    Yields:
        A list, filled once the block ends: ``root`` and the submodules
        called, in ``root.modules()`` order.

    Raises:
        HookError: ``root``, or a submodule the trace enters, holds a hook
            (see :func:`check_traced_hooks`).
    """
    check_traced_hooks(root, (root,), tracer)
    # ``root`` is seen already: the export adds a forward hook of its own.
    seen = {id(root)}
    mine = {id(m) for m in root.modules()}

    def record(module: nn.Module, _: Any) -> None:
        # A global pre-hook runs before the module's own hooks.
        if id(module) in mine and id(module) not in seen:
            seen.add(id(module))
            check_traced_hooks(root, (module,), tracer)

    entered: list[nn.Module] = []
    handle = register_module_forward_pre_hook(record)
    try:
        yield entered
    finally:
        handle.remove()
        entered.extend(m for m in root.modules() if id(m) in seen)


def _check_sized(root: nn.Module, module: nn.Module, tracer: str) -> None:
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        # Its hook would size the parameters at the trace, too late for
        # the stages' placement.
        name = name_in(root, module)
        raise TypeError(
            f"module '{name}' ({type(module).__name__}) has parameters not yet sized "
            f"(a lazy module), which torch.{tracer} cannot split: call the model once on a "
            f"batch before building the Pipe, which sizes them"
        )


def check_unsized(root: nn.Module, modules: Iterable[nn.Module], tracer: str) -> None:
    """Refuses, before a trace, a lazy module not yet sized among those the
    trace may follow: its sizing hook would run on the trace's stand-ins.

    Args:
        root: the traced module.
        modules: the modules whose code a trace may follow.
        tracer: ``"fx"`` or ``"export"``, for the message.

    Raises:
        TypeError: naming the module and saying to call the model once.
    """
    for module in modules:
        if module.__dict__.get("_forward_pre_hooks"):  # a lazy module's sizing hook
            _check_sized(root, module, tracer)


def check_traced_hooks(root: nn.Module, modules: Iterable[nn.Module], tracer: str) -> None:
    """Refuses hooks on the modules a trace entered.

    Args:
        root: the traced module.
        modules: the modules whose code the trace followed (``root`` among
            them, see :func:`entering`).
        tracer: ``"fx"`` or ``"export"``, for the advice.

    Raises:
        HookError: one of ``modules`` holds a hook (see the module's
            docstring), naming the module, the kind of hook and what to do.
        TypeError: a lazy module not yet sized.
    """
    for module in modules:
        # Run at every call over every module a trace entered: a module
        # with no hook at all (nearly all) costs four dict reads.
        d = module.__dict__
        if not (
            d.get("_forward_pre_hooks")
            or d.get("_forward_hooks")
            or d.get("_backward_pre_hooks")
            or d.get("_backward_hooks")
        ):
            continue
        _check_sized(root, module, tracer)
        kind = _hook_kind(module, module is not root)
        if kind is None:
            continue
        if module is root:
            raise _root_error(module, kind)
        name = name_in(root, module)
        if tracer == "fx":
            how = (
                f"torch.fx traces through '{name}', so its code, hooks included, is fixed in "
                f"the stages when traced. Name '{name}' in leaf_modules= (a leaf runs whole, "
                f"its hooks at every call), or register the hook on a layer a stage calls "
                f"whole"
            )
        else:
            how = (
                "torch.export traces through every submodule, so its code, hooks included, "
                "is fixed in the stages when exported. Split the module with tracer='fx' "
                f"and name '{name}' in leaf_modules= (a leaf runs whole, its hooks at every "
                f"call), or register the hook on the Pipe"
            )
        raise HookError(
            f"module '{name}' has a {kind}, which the pipe cannot run at each call (added "
            f"before the split, it would run once, on the trace's stand-ins; added after, "
            f"never): {how}"
        )

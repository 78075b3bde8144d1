"""Module hooks a pipe's stages would not run: refused, naming the module.

A stage runs the layers a Sequential's partition holds, and the submodules
``torch.fx`` calls whole (its leaves), as modules: their hooks run at every
call, as in the plain model. The code of every other module a trace
follows (the traced module, and each submodule ``torch.fx`` traces through;
for ``torch.export``, every module) becomes the stages' own code when it is
traced: a hook present then would run once, on the trace's stand-ins, its
effect fixed into the stages (still there after ``handle.remove()``), and
one registered later would never run. A full backward hook there would not
see the gradients it is meant to. So these modules are checked when the
pipe is built and at every call, and one holding a hook is refused
(Hugging Face transformers' own output-capturing hooks aside, and the
hooks of torch.nn.utils' ``spectral_norm``, hook-based ``weight_norm``
and ``prune``, and torch.ao.quantization's observer hooks, on a submodule:
tensor code a trace holds as the module's, run at every call).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

__all__ = ["check_root_hooks", "check_traced_hooks", "name_in", "recomputed_attribute"]

# A module's hook dicts, and how a message names each kind.
_KINDS = (
    ("_forward_pre_hooks", "forward pre-hook (register_forward_pre_hook)"),
    ("_forward_hooks", "forward hook (register_forward_hook)"),
    ("_backward_pre_hooks", "backward pre-hook (register_full_backward_pre_hook)"),
    ("_backward_hooks", "backward hook (register_full_backward_hook)"),
)


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


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


def _root_error(module: nn.Module, kind: str) -> TypeError:
    method = kind[kind.index("(") + 1 : -1]
    return TypeError(
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


def check_traced_hooks(root: nn.Module, modules: Iterable[nn.Module], tracer: str) -> None:
    """Refuses hooks on the modules whose code a trace follows.

    Args:
        root: the traced module.
        modules: the modules whose code the trace follows (``root`` among them).
        tracer: ``"fx"`` or ``"export"``, for the advice.

    Raises:
        TypeError: one of ``modules`` holds a hook (see the module's
            docstring), naming the module, the kind of hook and what to do.
    """
    for module in modules:
        # Run at every call over every module a trace follows: a module
        # with no hook at all (nearly all) costs four dict reads. A lazy
        # module not yet sized has one: its sizing forward pre-hook.
        d = module.__dict__
        if not (
            d.get("_forward_pre_hooks")
            or d.get("_forward_hooks")
            or d.get("_backward_pre_hooks")
            or d.get("_backward_hooks")
        ):
            continue
        if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
            # Its hook would size the parameters at the trace, too late for
            # the stages' placement.
            name = name_in(root, module)
            raise TypeError(
                f"module '{name}' ({type(module).__name__}) has parameters not yet sized "
                f"(a lazy module), which torch.{tracer} cannot split: call the model once on a "
                f"batch before building the Pipe, which sizes them"
            )
        # Containers are iterated, never called: their hooks never run.
        kind = None if isinstance(module, _CONTAINERS) else _hook_kind(module, module is not root)
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
        raise TypeError(
            f"module '{name}' has a {kind}, which the pipe cannot run at each call (added "
            f"before the split, it would run once, on the trace's stand-ins; added after, "
            f"never): {how}"
        )

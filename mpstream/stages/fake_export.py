"""``torch.export`` on fake tensors: a module's graph for one kind of call.

The export runs the module's Python code with fake tensors (no data, no
memory) standing in for its parameters, buffers and inputs, all on one
device, the first stage's: a module whose tensors already sit on several
devices (placed by an earlier split) exports the same way, and nothing is
copied. Only the call's dtypes, shapes and plain values matter; the batch
dimension (dim 0) of every tensor the pipeline splits is left to the export
to keep symbolic, so micro-batches of any size run the graph; that holds
for arguments a ``**kwargs`` parameter gathers too (see
:func:`_keywords_named`).
:func:`exported_graph` returns the graph with parameters read by qualified
name, ready for :func:`~mpstream.stages.export.export_stages` to cut.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree

from ..runtime.microbatch import NoChunk, grad_dtype
from .module_hooks import recomputed_attribute
from .quiet_export import quiet_export
from .stand_ins import stand_ins
from .tracers import raised_in

__all__ = ["ExportGraphError", "exported_graph", "input_pattern", "first_line"]

# Graph nodes that only check what export saw (dtype, device): a stage run
# under autocast sees other dtypes, and the checks compute nothing.
_CHECKS = (torch.ops.aten._assert_tensor_metadata.default,)


class ExportGraphError(TypeError):
    """What mpstream refuses of an exported graph (a tensor constant the
    forward creates, an input returned unchanged, an assignment to a plain
    tensor attribute). Its own class so that the export path passes it on
    as it is: worded as ``torch.export`` failing, its advice
    (data-dependent control flow) would point elsewhere."""


def first_line(exc: BaseException) -> str:
    """An exception's type and the first non-empty line of its message."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@contextmanager
def _fake_tensors(module: nn.Module, device: torch.device, mode: Any) -> Iterator[None]:
    """Stands fake tensors (of ``mode``, on ``device``) in for the module's
    parameters and buffers while it is exported; a tensor held under several
    names gets one fake, so ties stay ties."""
    fakes: dict[int, Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, Tensor]] = []
    fake: Any
    try:
        for mod in module.modules():
            for store in (mod._parameters, mod._buffers):
                for name, tensor in list(store.items()):
                    if tensor is None:
                        continue
                    fake = fakes.get(id(tensor))
                    if fake is None:
                        with mode:
                            fake = torch.empty_strided(
                                tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device
                            )
                        if isinstance(tensor, nn.Parameter):
                            fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
                        fakes[id(tensor)] = fake
                    assert fake is not None
                    swapped.append((store, name, tensor))
                    store[name] = fake
        yield
    finally:
        for store, name, tensor in reversed(swapped):
            store[name] = tensor


def _example(leaf: Any, device: torch.device, mode: Any) -> tuple[Any, Any]:
    """A fake stand-in for one input leaf and its dynamic-shape spec: the
    batch dimension (dim 0) of a tensor the pipeline splits is left to
    export (``Dim.AUTO``), a ``NoChunk`` tensor is static."""
    if isinstance(leaf, NoChunk):
        t = leaf.tensor
        with mode:
            return torch.empty(t.shape, dtype=t.dtype, device=device), None
    if isinstance(leaf, Tensor):
        # A batch of 1 would fix dim 0 to 1 (export specialises sizes 0 and
        # 1); the fake has no data, so 2 stands in for it.
        shape = (max(2, leaf.size(0)), *leaf.shape[1:]) if leaf.dim() else ()
        with mode:
            fake = torch.empty(shape, dtype=leaf.dtype, device=device)
        if leaf.requires_grad and grad_dtype(leaf):
            fake.requires_grad_(True)
        return fake, ({0: torch.export.Dim.AUTO} if leaf.dim() else None)
    return leaf, None


def _registered(x: Any) -> bool:
    """Whether ``x`` is an instance of a class registered with pytree (a
    dataclass given to ``register_dataclass``), not a standard container."""
    kind = type(x)
    return x is not None and kind in pytree.SUPPORTED_NODES and kind not in pytree.BUILTIN_TYPES


def _listed(tree: Any) -> Any:
    """``tree`` with each registered class's instance replaced by the list of
    its children: the structure ``torch.export`` matches ``dynamic_shapes``
    to, as such a class may not hold dimension specs in its fields."""

    def one(x: Any) -> Any:
        if not _registered(x):
            return x
        children = pytree.tree_leaves(x, is_leaf=lambda y: y is not x)
        return [_listed(c) for c in children]

    return pytree.tree_map(one, tree, is_leaf=_registered)


@contextmanager
def _keywords_named(module: nn.Module, names: list[str]) -> Iterator[None]:
    """While it is exported, ``module.forward`` says it takes by name each
    of ``names`` that its ``**kwargs`` would gather; calls still reach the
    forward itself.

    torch.export matches ``dynamic_shapes`` to the forward's parameters.
    torch 2.11 cannot match a spec to arguments in ``**kwargs``: keyed by
    their own names the spec is refused (the parameter's name is the key
    it wants), and keyed as ``{'kwargs': {...}}`` it passes that check but
    not the constraints computed after tracing, which list those arguments
    twice. Named in the signature, they are plain keyword-only parameters
    to every torch, and their batch dimension stays symbolic.
    """
    original = module.forward
    signature = inspect.signature(original)
    params = list(signature.parameters.values())
    gathers = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    own = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    extra = [n for n in names if n not in own]
    if not gathers or not extra:
        yield
        return
    kept = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in extra]

    def forward(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    forward.__signature__ = signature.replace(parameters=kept + added)  # type: ignore[attr-defined]
    # The instance's own forward, if it has one (a hook library's), comes back.
    before: Callable[..., Any] | None = module.__dict__.get("forward")
    module.__dict__["forward"] = forward
    try:
        yield
    finally:
        if before is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = before


def _export(
    module: nn.Module, named: dict[str, Any], device: torch.device
) -> torch.export.ExportedProgram:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    items, spec = pytree.tree_flatten(named)
    pairs = [_example(x, device, mode) for x in items]
    examples = pytree.tree_unflatten([p[0] for p in pairs], spec)
    shapes = pytree.tree_unflatten([p[1] for p in pairs], pytree.tree_structure(_listed(named)))
    # Autocast and grad mode around the call must not enter the graph: the
    # stages run under whatever the caller's are then.
    keywords = _keywords_named(module, list(named))
    with keywords, _fake_tensors(module, device, mode), torch.enable_grad():
        with torch.autocast(device.type, enabled=False), _plain_attributes(module):
            try:
                with quiet_export():
                    return torch.export.export(
                        module, (), examples, dynamic_shapes=shapes, strict=False
                    )
            except Exception as exc:
                _check_cumulative_norm(module, exc)
                raise


def _check_cumulative_norm(module: nn.Module, exc: BaseException) -> None:
    """Refuses by name a BatchNorm with ``momentum=None`` in training, where
    ``exc`` came from inside it: it averages its statistics over every batch
    so far, by a Python float torch reads off ``num_batches_tracked``, a
    value export cannot read (its failure names no cause).

    Raises:
        ExportGraphError: naming the BatchNorm and what to do.
    """
    name = raised_in(exc, module)
    norm = module.get_submodule(name) if name else None
    if not (
        isinstance(norm, nn.modules.batchnorm._BatchNorm)
        and norm.momentum is None
        and norm.training
        and norm.track_running_stats
    ):
        return
    raise ExportGraphError(
        f"torch.export cannot export {type(module).__name__}'s {type(norm).__name__} "
        f"'{name}' in training with momentum=None: it updates its running statistics by a "
        f"cumulative average, whose factor torch computes as a Python float from the "
        f"buffer num_batches_tracked, which an export cannot read. Give it a momentum (a "
        f"float; BatchNorm's default is 0.1), or let torch.fx split the module where it "
        f"can trace it (tracer='fx', which runs the BatchNorm whole), or pass an "
        f"nn.Sequential of stages; in eval mode it exports as it is"
    ) from exc


#: How torch warns that an export dropped a tensor attribute's assignment.
_ASSIGNED_WARNING = r"The tensor attributes? .* (was|were) assigned during export"


@contextmanager
def _plain_attributes(module: nn.Module) -> Iterator[None]:
    """While ``module`` is exported, copies stand in for its plain tensor
    attributes (no buffers): export runs a forward that changes one in place
    (``self.calls += 1``) on what the attribute holds, and records the
    change for the stages; the real tensor is left to them.

    Raises:
        ExportGraphError: forward assigns such an attribute
            (``self.calls = self.calls + 1``), which export drops: the
            stages would never change it.
    """
    with stand_ins(module, buffers=False) as changed, warnings.catch_warnings():
        # torch's own warning of such an assignment ("must be registered as
        # buffers"): the error below says it where it matters, naming the
        # attribute, and hook-based norms' assignments are harmless.
        warnings.filterwarnings("ignore", _ASSIGNED_WARNING, UserWarning)
        assigned: list[str] = []

        def check(*_: Any) -> None:
            # Export puts the module's attributes back before it returns.
            assigned.extend(c.name for c in changed() if c.assigned)

        hook = module.register_forward_hook(check)
        try:
            yield
        finally:
            hook.remove()
    assigned = [n for n in assigned if not _recomputed(module, n)]
    if assigned:
        name = assigned[0]
        attr = name.rpartition(".")[2]
        raise ExportGraphError(
            f"{type(module).__name__}.forward assigns the tensor attribute {name!r}, which is "
            f"no buffer: torch.export drops the assignment, so the stages would never change "
            f"it. Register it as a buffer in its module's __init__ "
            f"(self.register_buffer({attr!r}, ...)), which torch.export records"
        )


def _recomputed(module: nn.Module, name: str) -> bool:
    """Whether attribute ``name`` is what one of torch.nn.utils' hooks
    (``spectral_norm``, ``weight_norm``, ``prune``) sets before each forward
    of its module, from tensors the export sees: the forward reads the
    value it computes, so dropping the assignment loses nothing."""
    path, _, attr = name.rpartition(".")
    owner = module.get_submodule(path)
    return any(recomputed_attribute(h) == attr for h in owner._forward_pre_hooks.values())


def input_pattern(node: fx.Node) -> Any:
    """What the export fixed about one input (see ``ExportedStages.patterns``)."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    val = node.meta.get("val")
    if isinstance(val, Tensor):
        # A symbolic size the export resolved to a number is fixed too.
        dims = tuple(int(d) if is_concrete_int(d) else None for d in val.shape)
        return ("tensor", val.dtype, dims)
    return ("value", type(val), val)


def _unlifted(ep: torch.export.ExportedProgram) -> fx.GraphModule:
    """``ep``'s graph module with parameters read by name, its input checks
    left out of the graph.

    torch 2.9 added ``check_guards`` to keep a ``_guards_fn`` call out of the
    graph; earlier releases (the floor is 2.7) check inputs in a forward
    pre-hook instead, which cutting the graph into stages never runs.
    """
    if "check_guards" in inspect.signature(ep.module).parameters:
        gm = ep.module(check_guards=False)
    else:
        gm = ep.module()
    assert isinstance(gm, fx.GraphModule)
    return gm


def exported_graph(
    module: nn.Module, named: dict[str, Any], device: torch.device
) -> tuple[fx.GraphModule, pytree.TreeSpec, pytree.TreeSpec]:
    """``module(**named)`` exported on ``device``: its graph (parameters read
    by qualified name, checks dropped, inputs flat) and the structures of
    the call and of the result.

    Raises:
        Exception: whatever ``torch.export`` raised.
    """
    ep = _export(module, named, device)
    gm = _unlifted(ep)
    info = gm.graph._codegen.pytree_info  # type: ignore[attr-defined]
    gm.graph._codegen = fx.graph.CodeGen()
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _CHECKS:
            gm.graph.erase_node(node)
    gm.recompile()
    return gm, info.in_spec, info.out_spec

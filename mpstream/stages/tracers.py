"""Which tracer splits a module, how a call binds to it, and the report.

``Pipe(..., split_points=...)`` splits a module with ``torch.fx``
(:mod:`~mpstream.stages.fx`) or ``torch.export`` (:mod:`~mpstream.stages.exported`):
:func:`choose_tracer` picks which to try first, and
:meth:`mpstream.Pipe.split_report` returns a :class:`SplitReport` saying
which one split it and why. :class:`CallSignature` binds a call to a
module's ``forward`` by name, as ``torch.export`` takes it;
:class:`Binder`, to a ``torch.fx`` split's positional inputs (see
:mod:`~mpstream.stages.traced`).
"""

from __future__ import annotations

import dataclasses
import inspect
import keyword
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ..runtime.microbatch import NoChunk
from .hf import is_transformers_model

__all__ = [
    "SplitReport",
    "Binder",
    "CallSignature",
    "choose_tracer",
    "sample_call",
    "call_arguments",
    "nones_of",
    "describe_call",
    "raised_in",
    "TRACERS",
]

TRACERS = ("auto", "fx", "export")


@dataclass(frozen=True)
class SplitReport:
    """How a pipe was split into stages.

    Attributes:
        tracer: ``'nn.Sequential'`` (split by layers), ``'torch.fx'`` or
            ``'torch.export'``.
        reason: why that way.
        split_points: where the stages begin (None for a Sequential).
        exports: for ``torch.export``, one line per kind of call exported
            so far (training mode, the inputs and what was fixed of them);
            none before the first call of a pipe built without ``sample=``,
            which that call's arguments split.
        traces: for ``torch.fx``, one line per distinct trace so far (the
            training mode, the arguments traced as None, and the keys the
            code looks up that the call left out of a dict).
        loss: for ``torch.export``, how the model's own ``loss`` output is
            combined over micro-batches, per kind of call that returns one.
    """

    tracer: str
    reason: str
    split_points: tuple[str, ...] | None = None
    exports: tuple[str, ...] = ()
    loss: tuple[str, ...] = ()
    traces: tuple[str, ...] = ()

    def __str__(self) -> str:
        lines = [f"split by {self.tracer}: {self.reason}"]
        if self.split_points is not None:
            lines.append("split points: " + ", ".join(self.split_points))
        lines += [f"exported for: {e}" for e in self.exports]
        if self.tracer == "torch.export" and not self.exports:
            lines.append("exported for: nothing yet (the first call's arguments are the example)")
        lines += [f"traced for: {t}" for t in self.traces]
        lines += [f"loss: {x}" for x in self.loss]
        return "\n".join(lines)


def choose_tracer(module: nn.Module, tracer: str) -> tuple[str, str]:
    """The tracer to try first for ``module`` and why.

    Raises:
        ValueError: ``tracer`` is not one of :data:`TRACERS`.
    """
    if tracer not in TRACERS:
        raise ValueError(f"tracer must be one of {', '.join(map(repr, TRACERS))}; got {tracer!r}")
    if tracer == "fx":
        return "fx", "tracer='fx' was asked for"
    if tracer == "export":
        return "export", "tracer='export' was asked for"
    if is_transformers_model(module):
        return "export", (
            "a Hugging Face transformers model: its keyword arguments, ModelOutput and own loss "
            "go through torch.export"
        )
    return "fx", "torch.fx traced the module"


def sample_call(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A ``sample=`` as a call: a mapping (a dict, a ``BatchEncoding``) is
    keyword arguments, a tuple the positional ones, anything else the one
    input."""
    if isinstance(sample, Mapping):  # a dict, or a tokenizer's BatchEncoding
        return (), dict(sample)
    if isinstance(sample, tuple):
        return sample, {}
    return (sample,), {}


class Binder:
    """Turns a call's ``(args, kwargs)`` into a traced module's positional inputs.

    Args:
        module: the traced module.
        names: the ``forward`` parameters the split takes, in the
            pipeline's input order.
    """

    def __init__(self, module: nn.Module, names: list[str]) -> None:
        self.name = type(module).__name__
        self.signature = inspect.signature(module.forward)
        self.names = names
        for p in self.signature.parameters.values():
            if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                raise TypeError(
                    f"{self.name}.forward takes {p}; a traced pipeline needs named arguments"
                )

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Every argument of ``forward`` by name, defaults filled in.

        Raises:
            TypeError: the call does not bind to ``forward``.
        """
        return _arguments(self.name, self.signature, args, kwargs)

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        values = self.arguments(args, kwargs)
        return tuple(values[n] for n in self.names)


def _arguments(
    name: str, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{name}.forward{signature}: {exc}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def call_arguments(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Every argument of a call of ``module`` by name, defaults filled in
    (what :func:`nones_of` and a trace's lookups read).

    Raises:
        TypeError: the call does not bind to ``forward``.
    """
    name = type(module).__name__
    return _arguments(name, inspect.signature(module.forward), args, kwargs or {})


def nones_of(values: Mapping[str, Any], *, reads: bool = False) -> frozenset[str]:
    """What a ``torch.fx`` trace of a call fixes to None (see
    :mod:`~mpstream.stages.traced`): the arguments that are None, by name,
    and the None items inside the others, as pytree names them
    (``batch['mask']``, ``batch.scales.shift``, ``pair[1]``).

    Args:
        values: every argument of ``forward`` by name.
        reads: also name each None item every other way code reads it
            (``pair[1]`` and ``pair[-1]`` for a namedtuple's ``pair.shift``,
            ``batch[-1]`` for a list's ``batch[1]``): what the tracer looks
            up, and the kind of call (``[x, None]`` and ``[x, None, y]``
            differ in ``batch[-1]``); the report names each item once.
    """
    found: set[str] = set()
    for name, value in values.items():
        if value is None:
            found.add(name)
        elif not isinstance(value, Tensor):
            _none_items(value, name, found, reads)
    return frozenset(found)


def _none_items(value: Any, label: str, found: set[str], reads: bool) -> None:
    """Adds to ``found`` the None items inside ``value`` (named ``label``),
    named as pytree names them (and, with ``reads``, as code may read them);
    builtin containers without pytree (a call of every pipe's, so a few µs,
    not tens)."""
    items: list[tuple[str, Any]]
    kind = type(value)
    if kind is dict:
        items = [(f"[{k!r}]", x) for k, x in value.items()]
    elif kind is list or kind is tuple:
        items = [(f"[{i}]", x) for i, x in enumerate(value)]
    elif isinstance(value, tuple) and hasattr(kind, "_fields"):  # a namedtuple
        items = [(f".{f}", x) for f, x in zip(kind._fields, value)]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        # A registered dataclass's None fields are no children to pytree.
        items = [(f".{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif kind in pytree.SUPPORTED_NODES:
        level, _ = pytree.tree_flatten_with_path(value, is_leaf=lambda x: x is not value)
        items = [(pytree.keystr(path), x) for path, x in level]
    else:
        return  # a leaf
    n = len(value) if reads and isinstance(value, (list, tuple)) else 0
    for i, (key, x) in enumerate(items):
        if isinstance(x, Tensor):
            continue
        # A sequence's items by index too (a namedtuple's) and from the end.
        for name in dict.fromkeys((key, f"[{i}]", f"[{i - n}]")) if n else (key,):
            if x is None:
                found.add(label + name)
            else:
                _none_items(x, label + name, found, reads)


class CallSignature:
    """Binds a call to the module's ``forward`` by name, extra keyword
    arguments (``**kwargs``) included; defaults stay unset."""

    def __init__(self, module: nn.Module) -> None:
        self.name = type(module).__name__
        self.signature = inspect.signature(module.forward)

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name}.forward{self.signature}: {exc}") from None
        named: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                for key in value:
                    self._check_name(key)
                # By name: the order they came in is no part of the call's kind.
                named.update(sorted(value.items()))
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                if value:
                    raise TypeError(
                        f"{self.name}.forward takes *{name}: an exported pipeline passes "
                        f"arguments by name; give the extra positional arguments by name"
                    )
            else:
                named[name] = value
        return named

    def _check_name(self, key: str) -> None:
        """torch.export names each input after its keyword and generates
        Python code with it, which fails (a SyntaxError deep in tracing) on
        a key that could not be a parameter's name."""
        if not key.isidentifier() or keyword.iskeyword(key):
            raise TypeError(
                f"{self.name}.forward was given keyword argument {key!r}, which cannot be "
                f"a Python parameter name: torch.export names each input after its keyword "
                f"and fails on it; rename the key (a batch dict's keys become keyword "
                f"arguments)"
            )


def describe_call(named: dict[str, Any], training: bool, dtypes: Sequence[str]) -> str:
    """One line for the report: the mode, the dtypes and each argument (a
    tensor's dtype and shape, ``*`` for the batch dimension)."""
    parts = []
    for name, value in named.items():
        if isinstance(value, NoChunk):
            value = value.tensor
        if isinstance(value, Tensor):
            dims = ", ".join(["*", *map(str, value.shape[1:])]) if value.dim() else ""
            parts.append(f"{name} ({dims}) {str(value.dtype).replace('torch.', '')}")
        elif value is not None:
            parts.append(f"{name}={value!r}" if not isinstance(value, (dict, list, tuple))
                         else f"{name}=<{type(value).__name__}>")  # fmt: skip
    mode = "training" if training else "eval"
    kind = ", ".join([mode, *(d.replace("torch.", "") for d in dtypes)])
    return f"{kind}: " + ", ".join(parts)


def raised_in(exc: BaseException, module: nn.Module) -> str | None:
    """The innermost submodule of ``module`` whose code the exception (or
    what caused it) passed through."""
    names: dict[int, str] = {id(m): n for n, m in module.named_modules() if n}
    found: str | None = None
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if owner is not None and id(owner) in names:
                found = names[id(owner)]
            tb = tb.tb_next
        if found is not None:
            return found
        error = error.__cause__ or error.__context__
    return found

"""``isinstance``, ``type`` and ``hasattr`` on a traced argument, answered from the call traced.

``torch.fx`` traces every argument as a proxy, which is no dict, tuple or
tensor, and has every attribute: ``s = batch.pop("s", None) if
isinstance(batch, dict) else None`` would never take the dict branch, and
a call holding ``"s"`` would run without it, with no error; ``if
hasattr(batch, "keys"):`` would always take it. While a
:class:`~mpstream.stages.fx_tracer.Tracer` traces, :func:`answering_types`
puts an ``isinstance``, a ``type`` and a ``hasattr`` of its own in the
globals of each ``forward`` the trace follows: for an argument, or an item
or field of one (``batch["x"]``, ``batch.scales``), each answers as the
value the call holds there (``type(batch) is dict``), and records the
test (a typed
:class:`~mpstream.stages.lookups.Lookup`), so the argument's type is part
of the call's kind and a call of another type is traced again. Any other
value (a traced result, a constant) gets Python's own answer. Without a
call to answer from (the first trace without ``sample=``) such a test is
refused, naming the argument.

Code outside those modules (a helper in another file the forward calls)
sees the builtins, whose answer for a proxy is fx's (never a dict, every
attribute there); a module holding an ``isinstance``, ``type`` or
``hasattr`` of its own keeps it. The
``type`` put there is a subclass of ``type`` whose instances are the
classes, so ``isinstance(k, type)``, ``type.__new__``, ``type.mro`` and a
class deriving from it in that code mean what they did.

One trace patches at a time (a lock): two threads tracing at once would
each put back what the other had put there, and leave a module's globals
patched for good (``torch.fx`` patches process-wide state while it traces
too, and fails when two traces overlap).
"""

from __future__ import annotations

import builtins
import inspect
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from .fx_tracer import Tracer
from .lookups import NOTHING, Lookup, item_name, value_at
from .proxies import item_of

__all__ = ["answering_types"]


# What a module's globals hold under a name they held nothing under.
_UNSET = object()

# Held while a trace's answers are in the globals (see the module's doc);
# reentrant, for a trace that builds a pipe in its forward. The answers of
# each trace running in it, outermost first.
_patching = threading.RLock()
_active: list[dict[str, Any]] = []


class _Answer:
    """What a traced ``forward`` calls ``isinstance`` (see the module's doc)
    and ``type`` calls to answer an argument's type."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    def __call__(self, obj: object, classes: Any) -> bool:
        return isinstance(self.value(obj, "isinstance"), classes)

    def has(self, obj: object, name: str) -> bool:
        """What a traced ``forward`` calls ``hasattr``: the value's type, which
        the test records, answers it for any call of the kind."""
        return hasattr(self.value(obj, "hasattr"), name)

    def value(self, obj: object, test: str) -> Any:
        """``obj``, or the value the call holds where ``obj`` is an
        argument or an item of one, the test recorded."""
        item = item_of(obj)
        if item is None:
            return obj
        tracer = self.tracer
        where = f"forward tests the type of {item_name(item)} ({test})"
        if tracer.values is None:
            raise TypeError(
                f"{where}, which a trace answers from a call, and none was given: pass "
                f"Pipe(..., sample=...), a call like those to come"
            )
        value = value_at(tracer.values, item)
        if value is NOTHING:
            raise TypeError(
                f"{where}, which the call traced holds no value at (a key it leaves out, or "
                f"an attribute of what is no namedtuple or dataclass): test the argument "
                f"itself, or mark the submodule that tests it as a leaf "
                f"(Pipe(..., leaf_modules=[...]))"
            )
        tracer.lookups.add(Lookup(item, None, test=False, typed=True))
        return value


def _type_answering(answer: _Answer) -> type:
    """A subclass of ``type`` whose ``type(obj)`` is ``answer``'s, and whose
    instances are those of ``type`` (``isinstance(k, type)``, ``issubclass``)."""

    class Meta(type):
        # A class the code derives from the stand-in is a metaclass of its own.
        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            if cls is not stand_in:
                return super().__call__(*args, **kwargs)
            if len(args) == 1 and not kwargs:
                return type(answer.value(args[0], "type"))
            return type(*args, **kwargs)  # a new class: type(name, bases, namespace)

        def __instancecheck__(cls, obj: object) -> bool:
            return isinstance(obj, type) if cls is stand_in else type.__instancecheck__(cls, obj)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, type) if cls is stand_in else type.__subclasscheck__(cls, sub)

    # Derived from ``type``: its methods (``type.__new__``, ``type.mro``)
    # are found on the stand-in. ``type[int]`` in an annotation read while tracing.
    getitem = {"__class_getitem__": classmethod(lambda _, item: type[item])}
    stand_in: type = Meta("type", (type,), getitem)
    return stand_in


def _globals_of(modules: Sequence[nn.Module]) -> list[dict[str, Any]]:
    """The globals of each module's ``forward`` (and of what a decorator
    wraps), each once; none for a module without one of its own."""
    found: dict[int, dict[str, Any]] = {}
    for module in modules:
        forward = getattr(type(module), "forward", None)
        if forward is nn.Module.forward:
            # A ModuleList's: never run, and its module is torch's
            # nn.Module, whose __setattr__ would test what forward sets
            # (self.seen = batch["x"].mT refused), in every thread.
            continue
        for function in (forward, inspect.unwrap(forward) if callable(forward) else None):
            scope = getattr(function, "__globals__", None)
            if isinstance(scope, dict):
                found.setdefault(id(scope), scope)
    return list(found.values())


def _replaceable(name: str, value: Any) -> bool:
    """Whether a module's global ``name``, ``value``, is no one's but
    Python's or a trace's: none, the builtin, or an outer trace's answer."""
    return (
        value is _UNSET
        or value is getattr(builtins, name)
        or any(value is ours[name] for ours in _active)
    )


@contextmanager
def answering_types(tracer: Tracer, modules: Sequence[nn.Module]) -> Iterator[None]:
    """While it lasts, ``isinstance``, ``type`` and ``hasattr`` in the code
    of each module's ``forward`` answer from ``tracer``'s call.

    Args:
        tracer: the :class:`~mpstream.stages.fx_tracer.Tracer` tracing
            (its ``values``, the call, and ``lookups``, where each test goes).
        modules: the modules whose ``forward`` the trace follows.
    """
    answer = _Answer(tracer)
    ours = {"isinstance": answer, "type": _type_answering(answer), "hasattr": answer.has}
    with _patching:
        patched = []
        for scope in _globals_of(modules):
            # A global of a module's own under the name (a function, or any
            # value) stays: its code means that, as in the plain model.
            before = {n: scope.get(n, _UNSET) for n in ours}
            before = {n: v for n, v in before.items() if _replaceable(n, v)}
            scope.update({n: ours[n] for n in before})
            patched.append((scope, before))
        _active.append(ours)
        try:
            yield
        finally:
            _active.pop()
            for scope, before in reversed(patched):
                for name, value in before.items():
                    if value is _UNSET:
                        scope.pop(name, None)
                    else:
                        scope[name] = value

"""What a CUDA graph capture's warm-up changes, and how it is put back.

:class:`~mpstream.CapturedStep` runs real training steps before capture
(lazy initialisation, autotuning, optimizer state) and must then leave the
model and the optimizer as the caller gave them, in the very tensors the
graph captured. This module saves and restores that state (parameters,
buffers, gradients, optimizer state, random number generators) and, after
capture, checks that nothing a replay reads or writes was replaced
(:class:`Kept`); what the optimizer itself must allow is
:mod:`~mpstream.capture.optimizer`'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from .. import _ext
from ..runtime.graphed import generation
from ..runtime.stream import capturing
from .optimizer import Optimizer, state_tensors

_C = _ext.load()

__all__ = ["Kept", "Saved", "Trained"]


def _host(t: Tensor) -> Tensor:
    # In host memory: a model trained near the device's capacity has no room
    # for a second copy of its parameters and optimizer state.
    return t.detach().to("cpu", copy=True)


class Trained:
    """What a step trains: the pipe, a loss module's own tensors, and every
    other parameter the optimizer steps (a learnable loss scale held
    elsewhere), each with a name for messages.

    Args:
        pipe: the pipe.
        loss_fn: the loss function (its tensors count if it is a module).
        optimizer: the optimizer stepped in the step, if any.

    Raises:
        ValueError: the optimizer steps none of the pipe's parameters
            while some of them need gradients.
    """

    def __init__(self, pipe: nn.Module, loss_fn: object, optimizer: Optimizer | None) -> None:
        self.pipe, self.optimizer = pipe, optimizer
        self.modules: list[tuple[str, nn.Module]] = [("", pipe)]
        if isinstance(loss_fn, nn.Module):
            self.modules.append(("loss_fn.", loss_fn))
        self.params: list[tuple[str, nn.Parameter]] = []
        self.buffers: list[tuple[str, Tensor]] = []
        seen: set[int] = set()
        for prefix, module in self.modules:
            for name, t in (*module.named_parameters(), *module.named_buffers()):
                if id(t) not in seen:
                    seen.add(id(t))
                    held = self.params if isinstance(t, nn.Parameter) else self.buffers
                    held.append((prefix + name, t))  # type: ignore[arg-type]
        own = {id(p) for p in pipe.parameters()}
        groups = optimizer.param_groups if optimizer is not None else []
        stepped = {id(p) for g in groups for p in g["params"]}
        if groups and not stepped & own and any(p.requires_grad for p in pipe.parameters()):
            # Built on a copy of the model, say: the pipe would never train.
            raise ValueError(
                f"CapturedStep: the optimizer ({type(optimizer).__name__}) steps none of the "
                f"pipe's parameters, so the step would compute their gradients and never "
                f"update them; build it on pipe.parameters() (a copy of the model has "
                f"parameters of its own)"
            )
        for i, group in enumerate(groups):
            for j, p in enumerate(group["params"]):
                if id(p) not in seen:
                    seen.add(id(p))
                    self.params.append((f"parameter {j} of the optimizer's group {i}", p))
        #: The parameters outside the pipe (which ``pipe.zero_grad`` leaves).
        self.others = [p for _, p in self.params if id(p) not in own]
        loss = {id(p) for p in loss_fn.parameters()} if isinstance(loss_fn, nn.Module) else set()
        # A failed train_step puts back the gradients of the pipe and of a
        # loss module; these only the optimizer holds (a closure's loss scale).
        self.outside = [p for p in self.others if id(p) not in loss]

    def zero_grad(self) -> None:
        """Zeroes every gradient in place (a replay keeps writing into it)."""
        self.pipe.zero_grad(set_to_none=False)
        with torch.no_grad():
            for p in self.others:
                if p.grad is not None:
                    p.grad.zero_()

    @contextmanager
    def undone_on_failure(self, zeroed: bool) -> Iterator[None]:
        """Puts back the gradients of the parameters neither the pipe nor a
        loss module holds if the block (a ``train_step``) raises, as the
        step does its own: the same tensors (a replay writes into them),
        their values from before, or zeros where ``zeroed`` says they were
        zero (nothing copied). Under CUDA graph capture nothing is taken:
        a copy would be recorded and run on every replay."""
        outside = self.outside
        if not outside or capturing(p.device for p in outside):
            yield
            return
        with torch.no_grad():
            saved = [
                (p, p.grad, None if zeroed or p.grad is None else p.grad.clone()) for p in outside
            ]
        try:
            yield
        except BaseException:
            with torch.no_grad():
                for p, grad, copy in saved:
                    p.grad = grad
                    if grad is not None:
                        _put_back(grad, copy)
            raise


class Saved:
    """Parameters, buffers, gradients, optimizer state and RNG states.

    Everything is restored into the same tensors (``copy_``), because the
    graph captured their addresses. Optimizer state and gradients that
    warm-up created are zeroed (see :func:`~.optimizer.check_optimizer` for why that is
    the first step's state).

    Args:
        trained: what the step trains, and its optimizer.
        devices: the CUDA devices whose generators warm-up draws from.
    """

    def __init__(self, trained: Trained, devices: Sequence[torch.device]) -> None:
        self.params = [p for _, p in trained.params]
        self.optimizer = optimizer = trained.optimizer
        with torch.no_grad():
            tensors = (*self.params, *(b for _, b in trained.buffers))
            self.tensors = [(t, _host(t)) for t in tensors]
            self.grad_refs = {id(p): p.grad for p in self.params}
            self.grads = {id(p): _host(p.grad) for p in self.params if p.grad is not None}
            self.state = {(id(p), k): _host(v) for p, k, v in state_tensors(optimizer)}
            self.plain_state = {
                id(p): {k: v for k, v in s.items() if not isinstance(v, Tensor)}
                for p, s in (optimizer.state.items() if optimizer is not None else ())
            }
            self.state_keys = {
                id(p): set(s) for p, s in (optimizer.state.items() if optimizer is not None else ())
            }
        self.rng = torch.get_rng_state()
        self.cuda_rng = {d: torch.cuda.get_rng_state(d) for d in devices}

    def restore(self, captured: bool) -> None:
        """Puts everything back.

        Args:
            captured: whether a graph now owns the gradients and optimizer
                state warm-up created (they stay, zeroed); after a failed
                capture every parameter gets its own gradient tensor (or
                None) back and the optimizer loses the state warm-up made.
        """
        with torch.no_grad():
            for t, saved in self.tensors:
                t.copy_(saved)
            for p in self.params:
                if not captured:
                    p.grad = self.grad_refs.get(id(p))
                if p.grad is not None:
                    _put_back(p.grad, self.grads.get(id(p)))
            for param, key, value in state_tensors(self.optimizer):
                _put_back(value, self.state.get((id(param), key)))
            if self.optimizer is not None:
                for param, state in list(self.optimizer.state.items()):
                    state.update(self.plain_state.get(id(param), {}))
                    if captured:
                        continue
                    before = self.state_keys.get(id(param), set())
                    for key in set(state) - before:
                        del state[key]
                    if not state:
                        del self.optimizer.state[param]
        torch.set_rng_state(self.rng)
        for device, state in self.cuda_rng.items():
            torch.cuda.set_rng_state(state, device)


def _put_back(t: Tensor, saved: Tensor | None) -> None:
    """``t`` back to ``saved`` in place; zeros where warm-up created it."""
    if saved is None:
        t.zero_()
    else:
        t.copy_(saved)


class Kept:
    """The tensors a captured step reads and writes in place, as of capture:
    replacing one (a new ``.grad``, a moved or reassigned parameter, a
    swapped submodule, loaded optimizer state) or switching its
    ``requires_grad`` would leave the graph working as at capture.

    Args:
        trained: what the step trains, and its optimizer.
        zeroing: whether the step zeroes the gradients itself (for messages).
    """

    def __init__(self, trained: Trained, zeroing: bool) -> None:
        self.zeroing = zeroing
        self.children: list[tuple[str, nn.Module, str, nn.Module | None]] = []
        self.held: list[tuple[str, dict[str, Any], str, Tensor, int, bool]] = []
        for prefix, module in trained.modules:
            for path, m in module.named_modules(prefix=prefix.rstrip(".")):
                where = f"{path}." if path else ""
                for name, child in m._modules.items():
                    self.children.append((where + name, m, name, child))
                for table in (m._parameters, m._buffers):
                    for name, t in table.items():
                        if t is not None:
                            self.held.append(
                                (where + name, table, name, t, t.data_ptr(), t.requires_grad)
                            )
        owned = {id(t) for *_, t, _, _ in self.held}
        self.others = [
            (name, p, p.data_ptr(), p.requires_grad)
            for name, p in trained.params
            if id(p) not in owned
        ]
        self.grads = [(n, p, p.grad) for n, p in trained.params]
        self.state = list(state_tensors(trained.optimizer))
        self.optimizer = trained.optimizer
        # Every tensor's memory and layout in one C++ pass (sizes, strides:
        # `.t_()` too); the modules are walked only when it or a
        # registration somewhere (the generation) says something changed.
        held = [t for *_, t, _, _ in self.held]
        self.watch = _C.Watch([*held, *(p for _, p, _, _ in self.others)])
        self.seen = generation()
        with_grad = [(p, g) for _, p, g in self.grads if g is not None]
        self.attached = _C.Attached([p for p, _ in with_grad], [g for _, g in with_grad])
        self.gradless = [p for _, p, g in self.grads if g is None]

    def check(self) -> None:
        """Raises ValueError naming what was replaced or changed since capture."""
        if generation() != self.seen or self.watch.changed():
            self._walk()
            if self.watch.changed():
                raise ValueError(
                    "CapturedStep: a parameter or buffer was laid out anew in place since "
                    "capture (.t_(), .resize_(), .as_strided_()); the graph reads it as it "
                    "was. Capture a new step."
                )
            self.seen = generation()  # what registered was not the step's
        if self.attached.detached() or any(p.grad is not None for p in self.gradless):
            self._grads()
        self._state()

    def _walk(self) -> None:
        for where, parent, name, child in self.children:
            if parent._modules.get(name) is not child:
                raise ValueError(
                    f"CapturedStep: submodule {where} was replaced since capture; the graph "
                    f"runs the old one. Capture a new step."
                )
        # Tensors before gradients: moving a module replaces its gradients too.
        for where, table, name, t, _, _ in self.held:
            if table.get(name) is not t:
                raise ValueError(
                    f"CapturedStep: {where} was replaced by another tensor since capture "
                    f"(load_state_dict(assign=True), or a new nn.Parameter assigned); the "
                    f"graph reads and updates the old one. Capture a new step."
                )
        tensors = [(w, t, ptr, needs) for w, _, _, t, ptr, needs in self.held]
        for where, t, ptr, needs_grad in [*tensors, *self.others]:
            if t.data_ptr() != ptr:
                raise ValueError(
                    f"CapturedStep: {where} moved since capture (pipe.double(), "
                    f"pipe.to(dtype)); capture a new step."
                )
            if t.requires_grad != needs_grad:
                raise ValueError(
                    f"CapturedStep: requires_grad of {where} changed since capture; the graph "
                    f"computes its gradient as it did then. Capture a new step."
                )

    def _grads(self) -> None:
        for name, p, grad in self.grads:
            if p.grad is not grad:
                # The old tensor is gone from the caller's reach: only a new step helps.
                advice = (
                    "the step zeroes the gradients itself (zero_grad=True): drop the "
                    "zero_grad() call between calls"
                    if self.zeroing
                    else "zero them between calls with zero_grad(set_to_none=False), or "
                    "let the step zero them (CapturedStep(zero_grad=True))"
                )
                raise ValueError(
                    f"CapturedStep: the gradient of {name} was replaced since capture "
                    f"(zero_grad() sets it to None by default); the captured step "
                    f"accumulates into the old one. Capture a new step; {advice}."
                )

    def _state(self) -> None:
        state = self.optimizer.state if self.optimizer is not None else {}
        for p, key, value in self.state:
            if state.get(p, {}).get(key) is not value:
                raise ValueError(
                    f"CapturedStep: the optimizer's state {key!r} was replaced since capture "
                    f"(optimizer.load_state_dict?); the captured step updates the old "
                    f"tensors. Capture a new step after loading."
                )

"""One stage call captured as graphs and replayed: forward, and backward.

:class:`GraphedCall` holds the graphs of one stage for one slot and one
call signature: static input buffers, a forward graph writing static
outputs and, when the call needs gradients, a backward graph reading static
output gradients and writing the gradients of the differentiable inputs and
of the stage's parameters. A call copies the arguments' tensors into the
static inputs, replays the forward and returns *copies* of the outputs; its
backward (an autograd node, so ``loss.backward()``, ``train_step`` and the
user's own loop all reach it) replays the backward graph and returns copies
of the input gradients. Copies, because the next replay of the slot
overwrites the static buffers while readers on other streams (a copy to the
next device, a gradient copy back) may still be queued; with them, the
runtime's event plan and allocator protection apply unchanged. Parameter
gradients go straight to autograd's accumulation, on the stage's stream,
before any later replay.

Two backends capture: :class:`CudaGraphs` (``torch.cuda.CUDAGraph``, a
private memory pool per call) and :class:`Emulated`, a model of replay
semantics on any device for tests: its forward "replay" reruns the stage and
replaces the slot's one set of activations, so a slot reused while an
earlier micro-batch's backward is pending gives that backward the wrong
activations, as a real graph would.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ..memory.batchnorm import DeferredBatchNorm, deferred_norms
from .microbatch import leaves, rebuild_leaves

__all__ = ["Backend", "CudaGraphs", "Emulated", "GraphedCall"]


class Backend(Protocol):
    """Captures and replays the graphs of one :class:`GraphedCall`."""

    #: Whether a replay runs the stage's Python (then its side effects,
    #: such as deferred BatchNorm's counting, happen by themselves).
    runs_python: bool

    def capture(self, call: GraphedCall, fn: Callable[..., Any]) -> None:
        """Fills ``call``'s static outputs and gradients and arms its replays."""

    def forward(self, call: GraphedCall) -> None:
        """Replays the forward: static inputs to static outputs."""

    def backward(self, call: GraphedCall) -> None:
        """Replays the backward: static output gradients to static gradients."""


class GraphedCall:
    """The graphs of one stage call: static buffers and their replays.

    Args:
        fn: the stage's call (checkpointed or not), taking the arguments.
        args: an example of the arguments (their tensors' shapes, dtypes,
            devices and ``requires_grad`` are the call's signature; plain
            values are baked in).
        stage: the stage module (its parameters get gradients, its deferred
            BatchNorm layers are counted per replay).
        device: the stage's device.
        grad: whether the call builds an autograd graph.
        backend: what captures and replays.
        checkpoint: ``fn`` checkpoints the stage (its backward recomputes
            the forward).

    Raises:
        ValueError: what a graph cannot hold: a parameter with a tensor hook
            (the replay and autograd would both run it), or a tensor outside
            the stage's parameters that needs a gradient (the graph would
            leave it without one).
        Exception: whatever capture raised; the stage's buffers, deferred
            BatchNorm counters and random number generators are put back
            first.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        stage: nn.Module,
        device: torch.device,
        grad: bool,
        backend: Backend,
        checkpoint: bool = False,
    ) -> None:
        self.device = device
        self.checkpoint = checkpoint
        items, self.spec = leaves(tuple(args))
        self.items = list(items)
        self.where = [i for i, x in enumerate(items) if isinstance(x, Tensor)]
        self.static_in = [
            items[i].detach().clone().requires_grad_(grad and items[i].requires_grad)
            for i in self.where
        ]
        self.grad = grad
        self.params = [p for p in stage.parameters() if p.requires_grad] if grad else []
        hooked = [n for n, p in stage.named_parameters() if p._backward_hooks]
        if hooked:
            raise ValueError(
                f"parameter '{hooked[0]}' has a tensor hook (register_hook): a replayed "
                f"backward would run it inside the graph and autograd again outside"
            )
        self.norms = [n for n in deferred_norms(stage) if n.training]
        self.out_spec: Any = None
        self.out_items: list[Any] = []
        self.out_where: list[int] = []
        self.static_out: list[Tensor] = []
        self.diff_out: list[int] = []  # positions in static_out that carry gradients
        self.static_grad_out: list[Tensor] = []
        self.static_grad_in: list[Tensor | None] = []
        self.static_grad_params: list[Tensor | None] = []
        self.backend = backend
        self.state: Any = None  # the backend's own: graphs, or the emulated activations
        self.reserved = 0  # device memory reserved while capturing
        self.replays = 0  # forward replays whose backward may follow
        self.pending: weakref.ref[Any] | None = None  # the node of the last such replay
        self.label = "the stage"
        self.passes: tuple[str, ...] = ("forward",)
        with _restored(stage):
            backend.capture(self, fn)
        if self.diff_out:
            self.passes = ("forward", "backward")

    # -- what capture calls ---------------------------------------------
    def inputs(self) -> tuple[Any, ...]:
        """The arguments rebuilt around the static input buffers. One that
        needs a gradient goes in as a copy (inside the graph): the buffer is a
        leaf, which a stage beginning with an in-place op
        (``ReLU(inplace=True)``) may not modify."""
        items = list(self.items)
        for i, t in zip(self.where, self.static_in):
            items[i] = t.clone() if t.requires_grad else t
        return tuple(rebuild_leaves(items, self.spec))

    def outputs(self, out: Any) -> list[Tensor]:
        """Records the structure of a captured call's outputs; returns its tensors."""
        items, self.out_spec = leaves(out)
        self.out_items = list(items)
        self.out_where = [i for i, x in enumerate(items) if isinstance(x, Tensor)]
        tensors = [items[i] for i in self.out_where]
        self.diff_out = [k for k, t in enumerate(tensors) if self.grad and t.requires_grad]
        return tensors

    def grad_targets(self) -> list[Tensor]:
        """What the backward differentiates: inputs needing gradients, then parameters."""
        return [t for t in self.static_in if t.requires_grad] + self.params

    def check_leaves(self, outs: Sequence[Tensor]) -> None:
        """Refuses a captured call whose outputs' gradients reach a tensor
        other than its inputs and the stage's parameters (one the stage holds
        without registering it): the backward graph would not compute it.

        Raises:
            ValueError: naming the tensor's shape.
        """
        known = {id(t) for t in self.grad_targets()}
        seen: set[Any] = set()
        stack: list[Any] = [outs[k].grad_fn for k in self.diff_out]
        while stack:
            node = stack.pop()
            if node is None:
                continue
            if node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)
            if variable is not None and id(variable) not in known:
                raise ValueError(
                    f"a tensor of shape {tuple(variable.shape)} that is not a parameter of the "
                    f"stage needs a gradient: register it (nn.Parameter on the stage's module)"
                )
            stack.extend(n for n, _ in node.next_functions if n is not None)

    def busy(self) -> bool:
        """Whether the static activations belong to a forward whose backward
        may still run: its autograd node is alive and has not run."""
        return self.pending is not None and self.pending() is not None

    # -- replay ------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        items, _ = leaves(tuple(args))
        tensors = [items[i] for i in self.where]
        if self.diff_out and torch.is_grad_enabled():
            outs = _Replay.apply(self, *tensors, *self.params)
        else:
            outs = self._forward(tensors)
        result = list(self.out_items)
        for i, t in zip(self.out_where, outs):
            result[i] = t
        return rebuild_leaves(result, self.out_spec)

    def _forward(self, tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
        with torch.no_grad():
            for static, t in zip(self.static_in, tensors):
                static.copy_(t)
            self.backend.forward(self)
            if not self.backend.runs_python:
                for norm in self.norms:
                    norm.count_forward()
            return tuple(t.clone() for t in self.static_out)

    def _backward(self, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
        with torch.no_grad():
            for k, static in zip(self.diff_out, self.static_grad_out):
                g = grads[k]
                if g is None:
                    static.zero_()
                else:
                    static.copy_(g)
            self.backend.backward(self)
        in_grads = iter(self.static_grad_in)
        out: list[Tensor | None] = []
        for t in self.static_in:
            g = next(in_grads) if t.requires_grad else None
            out.append(None if g is None else g.clone())
        # Copies: a parameter's gradient may outlive the next replay (kept by
        # a hook, or returned by torch.autograd.grad), which overwrites ours.
        params = [None if g is None else g.clone() for g in self.static_grad_params]
        return out + params


class _Replay(torch.autograd.Function):
    """Replays a :class:`GraphedCall`; its backward replays the backward graph."""

    @staticmethod
    def forward(ctx: Any, call: GraphedCall, *tensors: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.call = call
        outs = call._forward(tensors[: len(call.where)])
        call.replays += 1
        ctx.replay = call.replays
        call.pending = weakref.ref(ctx)
        keep = set(call.diff_out)
        ctx.mark_non_differentiable(*(t for k, t in enumerate(outs) if k not in keep))
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        call: GraphedCall = ctx.call
        if getattr(ctx, "done", False):
            raise RuntimeError(
                f"{call.label}: a second backward through the same graphed forward "
                f"(retain_graph=True) would read activations its first backward reused; "
                f"run the pipe with graphs=False for that"
            )
        ctx.done = True
        if ctx.replay != call.replays:
            raise RuntimeError(
                f"{call.label}: its graphs replayed another micro-batch's forward before this "
                f"backward, so the activations it needs are gone (a backward run twice with "
                f"retain_graph=True after a new forward?); run the pipe with graphs=False for that"
            )
        call.pending = None
        return (None, *call._backward(grads))


@contextmanager
def _restored(stage: nn.Module) -> Iterator[None]:
    """Puts back on exit what warm-up and capture may change: the stage's
    buffers, its deferred BatchNorm counters, the random number generators."""
    buffers = [(b, b.detach().clone()) for b in stage.buffers()]
    counters = [
        (n, n.tracked, n.hold) for n in stage.modules() if isinstance(n, DeferredBatchNorm)
    ]
    for n, _, _ in counters:
        n.hold = True  # a commit must not be captured: each replay would run it
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for n, tracked, hold in counters:
            n.tracked, n.hold = tracked, hold
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _differentiate(
    call: GraphedCall, outputs: Sequence[Tensor], zeros: bool = False
) -> tuple[Tensor | None, ...]:
    """The gradients of the call's differentiable outputs, from the static
    output gradients, with respect to its inputs and parameters (``zeros``:
    from zeros, to shape the buffers)."""
    roots = [outputs[k] for k in call.diff_out]
    seeds = [torch.zeros_like(r) for r in roots] if zeros else call.static_grad_out
    return torch.autograd.grad(roots, call.grad_targets(), seeds, allow_unused=True)


def _store_grads(call: GraphedCall, grads: Sequence[Tensor | None]) -> None:
    n = sum(1 for t in call.static_in if t.requires_grad)
    call.static_grad_in = list(grads[:n])
    call.static_grad_params = list(grads[n:])


class CudaGraphs:
    """Captures with ``torch.cuda.CUDAGraph``, a private memory pool per call.

    Warm-up (``warmup`` eager iterations: lazy initialisation, cuDNN
    autotuning) and capture run on the stage's own stream, the current one
    inside its task: libraries keep per-stream workspaces (cuBLAS), and
    graphs of stages that run concurrently must not share one. Capture is
    thread-local (another thread's CUDA calls, a pinning DataLoader's, do not
    break it) and does not synchronise the device. Under autocast it runs
    with autocast's weight cache off: a cached cast freed after capture would
    leave the graph reading freed memory. Warm-up's effects are undone.

    A private pool per call, not one per device: stages sharing a device run
    concurrently on their own streams, and graphs sharing a pool may reuse
    each other's freed memory, which is only safe when they never run at the
    same time.

    Args:
        warmup: eager forward (+ backward) iterations before capture.
    """

    runs_python = False

    def __init__(self, warmup: int = 2) -> None:
        self.warmup = warmup

    def capture(self, call: GraphedCall, fn: Callable[..., Any]) -> None:
        index = call.device.index
        generator = torch.cuda.default_generators[
            torch.cuda.current_device() if index is None else index
        ]
        offset = generator.get_offset()
        for _ in range(self.warmup):
            outs = call.outputs(fn(*call.inputs()))
            if call.diff_out:
                call.static_grad_out = [torch.ones_like(outs[k]) for k in call.diff_out]
                _differentiate(call, outs)
            del outs
        if call.checkpoint and generator.get_offset() != offset:
            # Inside a graph the recomputation's restored RNG state is
            # relative to the backward graph's replay, not the forward's:
            # it would draw other masks than the forward did.
            raise ValueError(
                "a checkpointed stage that draws random numbers (dropout) cannot be replayed: "
                "its recomputation would draw other ones; checkpoint='never' graphs it"
            )
        fwd = torch.cuda.CUDAGraph()
        with ExitStack() as stack:
            _uncached_autocast(stack)
            with _capturing(fwd, None):
                outs = call.outputs(fn(*call.inputs()))
            call.static_out = [t.detach() for t in outs]
            graphs = [fwd]
            if call.diff_out:
                call.check_leaves(outs)
                call.static_grad_out = [torch.empty_like(outs[k]) for k in call.diff_out]
                bwd = torch.cuda.CUDAGraph()
                with _capturing(bwd, fwd.pool()):
                    _store_grads(call, _differentiate(call, outs))
                graphs.append(bwd)
        del outs
        call.reserved = _pool_bytes(fwd.pool())
        call.state = graphs

    def forward(self, call: GraphedCall) -> None:
        call.state[0].replay()

    def backward(self, call: GraphedCall) -> None:
        call.state[1].replay()


@contextmanager
def _capturing(graph: torch.cuda.CUDAGraph, pool: Any) -> Iterator[None]:
    """Captures what runs inside into ``graph``, on the current stream."""
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        yield
    finally:
        graph.capture_end()


def _pool_bytes(pool: Any) -> int:
    """Device memory held by a graph memory pool's segments."""
    segments = torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]
    mine = [s for s in segments if tuple(s.get("segment_pool_id", ())) == tuple(pool)]
    return sum(int(s["total_size"]) for s in mine)


def _uncached_autocast(stack: ExitStack) -> None:
    """Re-enters every active autocast with its weight cache off."""
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=False))


class Emulated:
    """Replay semantics without a device graph, for tests on any device.

    "Capture" runs the stage once on the static inputs; a forward "replay"
    runs it again and keeps that run's autograd graph as the slot's
    activations, replacing the previous one; a backward "replay"
    differentiates the slot's current activations. What differs from CUDA
    graphs: the stage's Python runs at every replay (its side effects too),
    and nothing is faster.
    """

    runs_python = True

    def __init__(self) -> None:
        self.captures = 0
        self.fns: dict[int, Callable[..., Any]] = {}

    def capture(self, call: GraphedCall, fn: Callable[..., Any]) -> None:
        self.captures += 1
        self.fns[id(call)] = fn
        with torch.enable_grad() if call.grad else torch.no_grad():
            outs = call.outputs(fn(*call.inputs()))
        call.static_out = [t.detach().clone() for t in outs]
        call.static_grad_out = [torch.empty_like(outs[k]) for k in call.diff_out]
        if call.diff_out:
            call.check_leaves(outs)
            # Fixed gradient buffers, as a graph's: what escapes them is seen.
            with torch.enable_grad():
                _store_grads(call, _differentiate(call, outs, zeros=True))

    def forward(self, call: GraphedCall) -> None:
        with torch.enable_grad() if call.grad else torch.no_grad():
            outs = call.outputs(self.fns[id(call)](*call.inputs()))
        for static, t in zip(call.static_out, outs):
            static.copy_(t.detach())
        call.state = outs if call.diff_out else None  # the slot's one set of activations

    def backward(self, call: GraphedCall) -> None:
        if call.state is None:
            raise RuntimeError("the slot's activations were freed before its backward replayed")
        with torch.enable_grad():
            grads = _differentiate(call, call.state)
        call.state = None
        for static, g in zip([*call.static_grad_in, *call.static_grad_params], grads):
            if static is not None:
                static.copy_(torch.zeros_like(static) if g is None else g)

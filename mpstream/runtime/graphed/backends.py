"""What captures and replays a graphed call (CUDA graphs, or an emulation),
and what its passes compute.

A call that needs gradients differentiates its outputs, from the static
output gradients, with respect to its inputs and the stage's parameters
(:func:`whole`). Where the schedule splits the backward, :func:`input_pass`
(B) stops at the inputs, keeping the gradients that flow into the junctions
of :class:`~mpstream.runtime.split_backward.Split`, and :func:`weight_pass`
(W) starts from them toward the parameters. Each pass ends in
:meth:`~.call.GraphedCall.write`: input gradients into their buffers,
parameter gradients added into the stage's store.

Memory (:class:`CudaGraphs`). Graphs that share a memory pool may reuse
what each other's captures freed, which is safe only for memory no graph
needs after its own replay. So a forward with gradients (whose activations
live until its backward), and a split call's B and W (B's junction
gradients live until W), take a pool of their own per call; a whole
backward and a forward without gradients take the stage's shared pool:
everything they allocate is dead when their replay ends, because what
outlives them (input gradients, outputs, parameter gradients) is written
into buffers allocated outside any pool. They replay on the stage's stream
only, one after another, in any order. Activations then cost what the
schedule keeps in flight, and temporaries one set per stage.

:class:`~.emulated.Emulated` models the same replay semantics on any
device, for tests, through the same pass functions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor

from ..split_backward import Split
from .backend import raised_eagerly
from .call import GraphedCall
from .capturing import capturing
from .rng import ordered

__all__ = [
    "CudaGraphs", "whole", "input_pass", "weight_pass", "split_of", "shares", "reached_from",
    "prepare", "positions",
]  # fmt: skip

#: Every pass a call may replay.
PASSES = frozenset({"forward", "backward", "weight"})


def whole(call: GraphedCall, outs: Sequence[Tensor]) -> tuple[Tensor | None, ...]:
    """The gradients of the call's differentiable outputs, from the static
    output gradients, with respect to its inputs and parameters."""
    roots = [outs[k] for k in call.diff_out]
    return torch.autograd.grad(roots, call.targets(), call.static_grad_out, allow_unused=True)


def split_of(call: GraphedCall, outs: Sequence[Tensor]) -> Split:
    """The call's backward cut inside it (its static inputs are B's sinks);
    sets the passes the call replays: B where it differentiates something,
    W where B leaves it work."""
    mine = {id(t) for t in call.static_in if t.requires_grad}
    roots = [outs[k] for k in call.diff_out]
    split = Split(roots, call.static_grad_out, lambda n: id(getattr(n, "variable", None)) in mine)
    b = ("backward",) if _b_targets(call, split) else ()
    call.passes = ("forward", *b, *(("weight",) if split.defers else ()))
    return split


def _b_targets(call: GraphedCall, split: Split) -> list[Tensor]:
    """What B differentiates: the inputs needing gradients, and the
    parameters B keeps."""
    if not (split.whole or split.reaches):
        return []
    kept = {id(p) for p in (call.params if split.whole else split.eager)}
    return [t for t in call.static_in if t.requires_grad] + [
        p for p in call.params if id(p) in kept
    ]


def input_pass(call: GraphedCall, outs: Sequence[Tensor], split: Split) -> list[Any]:
    """B inside the call: the input gradients, then per parameter its
    gradient if B computes it (None where W does)."""
    targets = _b_targets(call, split)
    n = sum(1 for t in call.static_in if t.requires_grad)
    if not targets:
        return [None] * (n + len(call.params))
    roots = [outs[k] for k in call.diff_out]
    with split.keeping():
        got = torch.autograd.grad(
            roots, targets, call.static_grad_out, retain_graph=True, allow_unused=True
        )
    by_id = {id(t): g for t, g in zip(targets[n:], got[n:])}
    return [*got[:n], *(by_id.get(id(p)) for p in call.params)]


def weight_pass(call: GraphedCall, split: Split) -> list[Any]:
    """W inside the call: per target, the parameter gradients B left."""
    got: dict[int, Tensor | None] = {}
    groups = split.groups()
    with split.pinned():
        for edges, values, params in groups:
            grads = torch.autograd.grad(edges, params, values, allow_unused=True)  # type: ignore[arg-type]
            got.update((id(p), g) for p, g in zip(params, grads))
    n = len(call.static_grad_in)
    return [None] * n + [got.get(id(p)) for p in call.params]


def shares(call: GraphedCall, name: str) -> bool:
    """Whether pass ``name`` of ``call`` may take the stage's shared pool:
    nothing it allocates is needed after its replay. A whole backward writes
    what outlives it into buffers allocated before capture; a forward
    without gradients too, where warm-up told its outputs' shapes. A forward
    with gradients leaves activations for its backward, and a split call's
    B leaves junction gradients for W."""
    if name == "backward":
        return not call.split
    return name == "forward" and not call.grad


def positions(grads: Sequence[Any], n: int) -> list[int]:
    """The parameter positions that got a gradient (targets after the ``n`` inputs)."""
    return [j for j, g in enumerate(grads[n:]) if g is not None]


def reached_from(
    outs: Sequence[Tensor], diff_out: Sequence[int], targets: Sequence[Tensor]
) -> list[frozenset[int]]:
    """Per target, the positions in ``outs`` (among ``diff_out``) whose
    autograd graph reaches it: a replayed backward computes zeros for a
    target only outputs without a gradient reach, where eager autograd gives
    it none.

    Raises:
        ValueError: the graph reaches a leaf that is not a target (a tensor
            the stage holds without registering it): the backward graph
            would not compute its gradient.
    """
    known = {id(t): i for i, t in enumerate(targets)}
    reached: list[set[int]] = [set() for _ in targets]
    for k in diff_out:
        seen: set[Any] = set()
        stack: list[Any] = [outs[k].grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)
            if variable is not None:
                if id(variable) not in known:
                    raise ValueError(
                        f"a tensor of shape {tuple(variable.shape)} that is not a parameter of "
                        f"the stage needs a gradient: register it (nn.Parameter on the stage's "
                        f"module)"
                    )
                reached[known[id(variable)]].add(k)
            stack.extend(n for n, _ in node.next_functions if n is not None)
    return [frozenset(r) for r in reached]


def prepare(call: GraphedCall, outs: Sequence[Tensor]) -> None:
    """After the forward's capture: which outputs reach what, and the
    gradient buffers, allocated outside any pool."""
    call.reached_from = reached_from(outs, call.diff_out, call.targets())
    call.static_grad_out = [torch.zeros_like(outs[k]) for k in call.diff_out]
    needing = [(t, to) for t, to in zip(call.static_in, call.grad_to) if t.requires_grad]
    call.static_grad_in = [
        None if not call.reached_from[i] else torch.zeros_like(t) if to is None else to
        for i, (t, to) in enumerate(needing)
    ]
    grads = iter(call.static_grad_in)
    call.unreached_in = tuple(
        i for i, t in enumerate(call.static_in) if t.requires_grad and next(grads) is None
    )


class CudaGraphs:
    """Captures with ``torch.cuda.CUDAGraph`` (pools: see the module).

    Warm-up (``warmup`` eager iterations: lazy initialisation, cuDNN
    autotuning) and capture run on the stage's own stream, the current one
    inside its task: libraries keep per-stream workspaces (cuBLAS), and
    graphs of stages that run concurrently must not share one. Capture is
    thread-local (another thread's CUDA calls, a pinning DataLoader's, do not
    break it) and does not synchronise the device. Under autocast it runs
    with autocast's weight cache off: a cached cast freed after capture would
    leave the graph reading freed memory. Warm-up's effects are undone, and
    its backward adds nothing anywhere.

    Warm-up also finds the passes that draw random numbers (the generator's
    offset moves; ``call.random_passes``): their replays, and every capture,
    write the generator's graph scalars, so they take turns per device
    (:func:`~mpstream.runtime.graphed.rng.ordered`).

    Args:
        warmup: eager forward (+ backward) iterations before capture.
    """

    runs_python = False

    def __init__(self, warmup: int = 2) -> None:
        self.warmup = warmup
        #: Graph launches so far (one per replayed pass).
        self.replays = 0
        # Backward replays of the user's loop run on autograd's device threads.
        self._count = threading.Lock()

    # A pipe built with a backend holds it: its copies and pickles take a
    # lock of their own (a lock cannot be copied).
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_count"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._count = threading.Lock()

    def capture(self, call: GraphedCall, fn: Callable[..., Any]) -> None:
        index = call.device.index
        generator = torch.cuda.default_generators[
            torch.cuda.current_device() if index is None else index
        ]
        call.random_passes, shapes = warm_up(call, fn, self.warmup, generator.get_offset)
        if call.checkpoint and call.random_passes:  # seen drawing, or not warmed up to tell
            # Inside a graph the recomputation's restored RNG state is
            # relative to the backward graph's replay, not the forward's:
            # it would draw other masks than the forward did.
            unknown = "" if self.warmup else " (or may: without warm-up it cannot be told)"
            raise ValueError(
                f"a checkpointed stage that draws random numbers (dropout){unknown} cannot be "
                f"replayed: its recomputation would draw other ones; checkpoint='never' graphs it"
            )
        own = torch.cuda.graph_pool_handle()
        shared = call.pool if call.pool is not None else own
        graphs: dict[str, torch.cuda.CUDAGraph] = {}
        with ExitStack() as stack:
            _uncached_autocast(stack)
            stack.enter_context(ordered(call.device))  # capture_begin writes the RNG scalars
            # Without gradients nothing outlives the replay but the outputs,
            # copied into buffers of their own: the shared pool.
            copied = shares(call, "forward") and shapes is not None and call.pool is not None
            if copied:
                call.static_out = [
                    torch.empty_strided(shape, stride, dtype=dtype, device=device)
                    for shape, stride, dtype, device in shapes or ()
                ]
            graphs["forward"] = graph = torch.cuda.CUDAGraph()
            with capturing(graph, shared if copied else own, owner=call):
                outs = call.outputs(fn(*call.inputs()))
                if copied:
                    if [(t.shape, t.stride(), t.dtype) for t in outs] != [
                        s[:3] for s in shapes or ()
                    ]:
                        raise RuntimeError("the outputs' shapes differ between warm-up and capture")
                    for buf, t in zip(call.static_out, outs):
                        buf.copy_(t)
            if not copied:
                call.static_out = [t.detach() for t in outs]
                call.pooled_out = True
            if call.diff_out:
                prepare(call, outs)
                graphs.update(_capture_backward(call, outs, own, shared))
        del outs
        call.reserved = _pool_bytes(own)
        call.state = graphs

    def replay(self, call: GraphedCall, name: str) -> None:
        """Replays one pass; in the device's order if it draws random numbers
        (its replay prologue writes the generator's scalars)."""
        graph: torch.cuda.CUDAGraph = call.state[name]
        with self._count:
            self.replays += 1
        if name in call.random_passes:
            with ordered(call.device):
                graph.replay()
        else:
            graph.replay()


def warm_up(
    call: GraphedCall, fn: Callable[..., Any], runs: int, position: Callable[[], object]
) -> tuple[frozenset[str], list[tuple[Any, ...]] | None]:
    """Runs the call eagerly ``runs`` times, forward and (where gradients
    flow) backward, as capture will, adding no gradient anywhere. Returns the
    passes that moved the random number generator (``position``: where it
    stands; with no run nothing is known, and every pass counts as drawing),
    and the outputs' shapes, strides, dtypes and devices (None without a run)."""
    drew: set[str] = set()
    shapes: list[tuple[Any, ...]] | None = None
    for _ in range(runs):
        start = position()
        try:
            outs = call.outputs(fn(*call.inputs()))
        except Exception as exc:
            # The stage's forward, run as the caller's would be: its own
            # error. A backward that fails here is the capture's (the caller
            # may never run one: a forward with gradients enabled, say).
            raised_eagerly(exc)
            raise
        shapes = [(t.shape, t.stride(), t.dtype, t.device) for t in outs]
        if position() != start:
            drew.add("forward")
        start = position()
        if call.diff_out:
            grads = [torch.ones_like(outs[k]) for k in call.diff_out]
            roots = [outs[k] for k in call.diff_out]
            if call.split:
                call.static_grad_out = grads
                split = split_of(call, outs)
                input_pass(call, outs, split)
                if split.defers:
                    weight_pass(call, split)
            else:
                call.passes = ("forward", "backward")
                torch.autograd.grad(roots, call.targets(), grads, allow_unused=True)
        del outs
        if position() != start:
            drew.update(("backward", "weight"))  # W runs part of the backward
    return (frozenset(drew) if runs else PASSES), shapes


def _capture_backward(
    call: GraphedCall, outs: Sequence[Tensor], own: Any, shared: Any
) -> dict[str, torch.cuda.CUDAGraph]:
    """The backward's graphs: whole in the shared pool; B and W in the
    call's own. A pass with nothing to compute gets no graph (PyTorch warns
    of an empty one)."""
    n = len(call.static_grad_in)
    if not call.split:
        call.passes = ("forward", "backward")
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, shared if shares(call, "backward") else own, owner=call):
            got = whole(call, outs)
            call.write(got, positions(got, n), "backward")
        return {"backward": graph}
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    split = split_of(call, outs)
    if "backward" in call.passes:
        graphs["backward"] = torch.cuda.CUDAGraph()
        with capturing(graphs["backward"], own, owner=call):
            first = input_pass(call, outs, split)
            call.write(first, positions(first, n), "backward")
    if split.defers:
        # Captured after B, while B's junction gradients are still held:
        # W reads them, so W's allocations must not land on them.
        graphs["weight"] = torch.cuda.CUDAGraph()
        with capturing(graphs["weight"], own, owner=call):
            second = weight_pass(call, split)
            call.write(second, positions(second, n), "weight")
    return graphs


def _pool_bytes(pool: Any) -> int:
    """Device memory held by a graph memory pool's segments."""
    segments = torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]
    mine = [s for s in segments if tuple(s.get("segment_pool_id", ())) == tuple(pool)]
    return sum(int(s["total_size"]) for s in mine)


def pool_bytes(pool: Any) -> int:
    """Device memory held by a shared pool (0 for none, or off a GPU)."""
    initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return 0 if pool is None or not initialized else _pool_bytes(pool)


def _uncached_autocast(stack: ExitStack) -> None:
    """Re-enters every active autocast with its weight cache off."""
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=False))

"""What captures and replays a graphed call: CUDA graphs, or an emulation.

:class:`CudaGraphs` captures with ``torch.cuda.CUDAGraph``, a private memory
pool per call; :mod:`.capturing` undoes a capture that fails, and
:mod:`.rng` puts captures and random replays in their device's order.
:class:`Emulated` models replay semantics on any device, for
tests: its forward "replay" reruns the stage and replaces the slot's one set
of activations, so a slot reused while an earlier micro-batch's backward is
pending gives that backward the wrong activations, as a real graph would.
Both run the passes of :mod:`~mpstream.runtime.graphed.passes`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor

from .call import GraphedCall
from .capturing import capturing
from .passes import (
    differentiate,
    eager_backward,
    input_pass,
    merge,
    set_passes,
    split_of,
    store_grads,
    weight_pass,
)
from .rng import ordered

__all__ = ["CudaGraphs", "Emulated", "PASSES", "warm_up"]

#: Every pass a call may replay.
PASSES = frozenset({"forward", "backward", "weight"})


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

    A private pool per call (one handle for its forward and backward
    graphs), not one per device: stages sharing a device run concurrently on
    their own streams, and graphs sharing a pool may reuse each other's freed
    memory, which is only safe when they never run at the same time.

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

    def capture(self, call: GraphedCall, fn: Callable[..., Any]) -> None:
        index = call.device.index
        generator = torch.cuda.default_generators[
            torch.cuda.current_device() if index is None else index
        ]
        call.random_passes = warm_up(call, fn, self.warmup, generator.get_offset)
        if call.checkpoint and call.random_passes:  # seen drawing, or not warmed up to tell
            # Inside a graph the recomputation's restored RNG state is
            # relative to the backward graph's replay, not the forward's:
            # it would draw other masks than the forward did.
            unknown = "" if self.warmup else " (or may: without warm-up it cannot be told)"
            raise ValueError(
                f"a checkpointed stage that draws random numbers (dropout){unknown} cannot be "
                f"replayed: its recomputation would draw other ones; checkpoint='never' graphs it"
            )
        pool = torch.cuda.graph_pool_handle()
        fwd = torch.cuda.CUDAGraph()
        with ExitStack() as stack:
            _uncached_autocast(stack)
            stack.enter_context(ordered(call.device))  # capture_begin writes the RNG scalars
            with capturing(fwd, pool):
                outs = call.outputs(fn(*call.inputs()))
            call.static_out = [t.detach() for t in outs]
            graphs: dict[str, torch.cuda.CUDAGraph] = {"forward": fwd}
            if call.diff_out:
                call.check_leaves(outs)
                call.static_grad_out = [torch.empty_like(outs[k]) for k in call.diff_out]
                graphs.update(_capture_backward(call, outs, pool))
        del outs
        call.reserved = _pool_bytes(pool)
        call.state = graphs

    def forward(self, call: GraphedCall) -> None:
        _replay(call, "forward")

    def backward(self, call: GraphedCall) -> None:
        if "backward" in call.state:
            _replay(call, "backward")

    def weight(self, call: GraphedCall) -> None:
        _replay(call, "weight")


def _replay(call: GraphedCall, name: str) -> None:
    """Replays one of the call's graphs; in the device's order if it draws
    random numbers (its replay prologue writes the generator's scalars)."""
    graph: torch.cuda.CUDAGraph = call.state[name]
    if name in call.random_passes:
        with ordered(call.device):
            graph.replay()
    else:
        graph.replay()


def warm_up(
    call: GraphedCall, fn: Callable[..., Any], runs: int, position: Callable[[], object]
) -> frozenset[str]:
    """Runs the call eagerly ``runs`` times, forward and (where gradients
    flow) backward, as capture will; returns the passes that moved the random
    number generator (``position``: where it stands). With no run nothing is
    known, and every pass counts as drawing."""
    drew: set[str] = set()
    for _ in range(runs):
        start = position()
        outs = call.outputs(fn(*call.inputs()))
        if position() != start:
            drew.add("forward")
        start = position()
        if call.diff_out:
            call.static_grad_out = [torch.ones_like(outs[k]) for k in call.diff_out]
            eager_backward(call, outs)
        del outs
        if position() != start:
            drew.update(("backward", "weight"))  # W runs part of the backward
    return frozenset(drew) if runs else PASSES


def _capture_backward(
    call: GraphedCall, outs: Sequence[Tensor], pool: Any
) -> dict[str, torch.cuda.CUDAGraph]:
    """The backward's graphs, in the forward's pool: one, or B and W. A pass
    with nothing to compute gets no graph (PyTorch warns of an empty one)."""
    if not call.split:
        call.passes = ("forward", "backward")
        whole = torch.cuda.CUDAGraph()
        with capturing(whole, pool):
            store_grads(call, differentiate(call, outs))
        return {"backward": whole}
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    split = split_of(call, outs)
    set_passes(call, split)
    n = sum(1 for t in call.static_in if t.requires_grad)
    first: list[Any] = [None] * (n + len(call.params))
    if "backward" in call.passes:
        graphs["backward"] = torch.cuda.CUDAGraph()
        with capturing(graphs["backward"], pool):
            first = input_pass(call, outs, split)
    if split.defers:
        # Captured after B, while B's junction gradients are still held:
        # W reads them, so W's allocations must not land on them.
        graphs["weight"] = torch.cuda.CUDAGraph()
        with capturing(graphs["weight"], pool):
            second = weight_pass(call, split)
        first = merge(call, first, second)
    store_grads(call, first)
    return graphs


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
        call.static_grad_out = [torch.zeros_like(outs[k]) for k in call.diff_out]
        if call.diff_out:
            call.check_leaves(outs)
            # Fixed gradient buffers, as a graph's: what escapes them is seen.
            with torch.enable_grad():
                store_grads(call, eager_backward(call, outs))

    def forward(self, call: GraphedCall) -> None:
        with torch.enable_grad() if call.grad else torch.no_grad():
            outs = call.outputs(self.fns[id(call)](*call.inputs()))
        for static, t in zip(call.static_out, outs):
            static.copy_(t.detach())
        call.state = outs if call.diff_out else None  # the slot's one set of activations

    def backward(self, call: GraphedCall) -> None:
        if call.state is None:
            raise RuntimeError("the slot's activations were freed before its backward replayed")
        outs, call.state = call.state, None
        with torch.enable_grad():
            if not call.split:
                _fill([*call.static_grad_in, *call.static_grad_params], differentiate(call, outs))
                return
            split = split_of(call, outs)
            first = input_pass(call, outs, split)
        if not call.weighs_later:
            _fill([*call.static_grad_in, *call.static_grad_params], first)
            return
        _fill(call.static_grad_in, first[: len(call.static_grad_in)])
        call.state = ("weight", outs, split, first)  # W reads B's activations and gradients

    def weight(self, call: GraphedCall) -> None:
        if not (isinstance(call.state, tuple) and call.state[0] == "weight"):
            raise RuntimeError("a weight pass replayed without its input-gradient pass")
        _, _, split, first = call.state
        call.state = None
        with torch.enable_grad():
            merged = merge(call, first, weight_pass(call, split))
        _fill(call.static_grad_params, merged[len(call.static_grad_in) :])


def _fill(statics: Sequence[Tensor | None], grads: Sequence[Tensor | None]) -> None:
    """Copies gradients into fixed buffers (zeros for a gradient that did not flow)."""
    for static, g in zip(statics, grads):
        if static is not None:
            static.copy_(torch.zeros_like(static) if g is None else g)

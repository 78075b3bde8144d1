"""A training step's graphed stages: their tasks without autograd.

Where a stage replays graphs (``Pipe(graphs=True)``), its training-step tasks
call the graphs directly (:class:`~.graphed.call.GraphedCall`): the forward
task copies the arguments into the call's static inputs and launches the
forward graph, the backward task copies the output gradients in and
launches the backward graph (which adds the parameter gradients into the
stage's gradient buffers itself), and a weight task launches W. Autograd
never runs for such a stage, so a task's host work is a few calls.

What passes between tasks is the graphs' own buffers, kept valid by the
slots and the event plan rather than by copies:

- a stage's outputs are handed on as its static outputs; a graphed reader
  copies them into its static inputs (in its forward task, on its stream),
  an eager one reads them (copied first where its backward is split: its
  weight pass may run after the producer's next forward into that slot);
  the producer writes them again only after every reader's backward, which
  the schedule orders before the producer's own;
- an input gradient goes back as the reader's static input gradient, copied
  on the reader's stream straight into the producer's static output
  gradient where the value has no other reader on that device (the
  producer's previous backward from that slot finished before this
  micro-batch's forward could start); otherwise a copy of it goes the way
  the eager pipe routes gradients (summed by the producer, or by a gradient
  copy to another device);
- the last stage's outputs are cut (:mod:`~.boundary`) so that the loss can
  differentiate them; their gradients reach its backward like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .boundary import Cutting, Grads, sum_grads
from .graph import ALL, Ref, Routes
from .graphed import GraphedCall, StageGraphs
from .microbatch import grad_dtype, leaves, rebuild_leaves

__all__ = ["Replayed"]

# Where the gradient of one tensor argument goes: (producer, output, leaf),
# or None for the pipeline's inputs (detached in a training step).
Key = tuple[int, int, int] | None


class Replayed:
    """The graphed stages of one training step.

    Args:
        graphs: the pipe's graphed stages (begun for this step).
        routes: the stage graph on this step's devices.
    """

    def __init__(self, graphs: StageGraphs, routes: Routes) -> None:
        self.graphs = graphs
        self.routes = routes
        graph = routes.graph
        self.outputs = graph.outputs
        # (producer, output) read by one stage argument only (a result ref
        # counts as a reader: the loss's gradient comes back through it).
        count: dict[tuple[int, int], int] = {}
        for refs in graph.args:
            for r in refs:
                if r.stage >= 0:
                    for k in range(self.outputs[r.stage]) if r.index == ALL else (r.index,):
                        count[(r.stage, k)] = count.get((r.stage, k), 0) + 1
        for r in graph.result_refs():
            count[(r.stage, r.index)] = count.get((r.stage, r.index), 0) + 1
        self.single = {key for key, n in count.items() if n == 1}
        self.calls: dict[tuple[int, int], tuple[GraphedCall, list[Key]]] = {}
        self.pushed: dict[tuple[int, int], set[int]] = {}
        self.weights: dict[tuple[int, int], GraphedCall] = {}
        self._diff: dict[int, dict[tuple[int, int], int]] = {}

    def forward(
        self,
        s: int,
        m: int,
        stage: nn.Module,
        pairs: Sequence[tuple[Ref, Any]],
        checkpoint: bool,
        split: bool,
    ) -> tuple[bool, Any]:
        """Replays stage ``s``'s forward of micro-batch ``m`` if it is graphed.

        Returns:
            Whether it was, and then the stage's output (static buffers).
        """
        items: list[Any] = []
        keys: list[Key] = []
        needs: list[bool] = []
        for ref, value in pairs:
            flat = [value] if type(value) is Tensor else leaves(value)[0]
            j = 0
            for x in flat:
                items.append(x)
                if isinstance(x, Tensor):
                    need = ref.stage >= 0 and grad_dtype(x)
                    needs.append(need)
                    keys.append((ref.stage, ref.index, j) if need else None)
                    j += 1
        args = [v for _, v in pairs]
        call = self.graphs.thin(s, m, stage, args, needs, checkpoint, split)
        if call is None:
            return False, None
        tensors = [x for x in items if isinstance(x, Tensor)]
        y = call.rebuild(call.forward(tensors))
        self.calls[(s, m)] = (call, [k for k, n in zip(keys, needs) if n])
        return True, y

    def unalias(self, s: int, m: int, pairs: Sequence[tuple[Ref, Any]]) -> list[tuple[Ref, Any]]:
        """``pairs`` (an eager stage's arguments) with what replayed producers
        on this device handed on copied: the stage's split backward may run
        its weight pass after the producer's next forward into that slot."""
        out: list[tuple[Ref, Any]] = []
        for ref, value in pairs:
            if self.graphed(ref.stage, m) and self.routes.hop(ref.stage, s) is None:
                items, spec = leaves(value)
                value = rebuild_leaves(
                    [x.clone() if isinstance(x, Tensor) else x for x in items], spec
                )
            out.append((ref, value))
        return out

    def graphed(self, s: int, m: int) -> bool:
        """Whether stage ``s``'s forward of micro-batch ``m`` was replayed."""
        return (s, m) in self.calls

    def backward(self, s: int, m: int, reached: Grads, split: bool) -> Cutting | None:
        """Replays the backward of a replayed forward from the gradients that
        reached its outputs (plus those pushed into its buffers); pushes its
        input gradients to producers that take them so. Returns the rest, as
        a :class:`~.boundary.Cutting` to route like an eager stage's."""
        call, keys = self.calls.pop((s, m))
        diff = self._positions(call, s)
        pushed = self.pushed.pop((s, m), set())
        grads: list[Tensor | None] = [None] * len(call.diff_out)
        for i in pushed:
            grads[i] = call.static_grad_out[i]  # already there
        for where, parts in reached.items():
            at = diff.get(where)
            if at is not None and parts:
                grads[at] = sum_grads(parts)
        ins = call.backward(grads, self.graphs.token, weight=not split)
        if split:
            self.weights[(s, m)] = call
        rest = Cutting()
        out: list[Tensor | None] = []
        for key, g in zip(keys, ins):
            if g is None or key is None:
                continue
            p, k, j = key
            if not self._push(p, k, j, s, m, g):
                rest.keys.append(key)
                out.append(g.clone())  # the buffer is this slot's: rewritten by its next backward
        rest.sink.grads = tuple(out)
        return rest if rest.keys else None

    def weight(self, s: int, m: int) -> bool:
        """Replays W of a split replayed backward; whether there was one."""
        call = self.weights.pop((s, m), None)
        if call is None:
            return False
        call.weight()
        return True

    def _push(self, p: int, k: int, j: int, s: int, m: int, g: Tensor) -> bool:
        """Copies ``g`` into producer ``p``'s static output gradient, if ``p``
        replayed micro-batch ``m`` on this device and this stage is the
        value's only reader; whether it did."""
        rec = self.calls.get((p, m))
        if rec is None or (p, k) not in self.single or self.routes.hop(p, s) is not None:
            return False
        producer = rec[0]
        i = self._positions(producer, p).get((k, j))
        if i is not None:
            with torch.no_grad():
                producer.static_grad_out[i].copy_(g)
            self.pushed.setdefault((p, m), set()).add(i)
        return True  # an output without a gradient in the producer takes none

    def _positions(self, call: GraphedCall, s: int) -> dict[tuple[int, int], int]:
        """Per (output, leaf) of stage ``s`` (``call``'s), its position among
        the call's differentiable outputs."""
        found = self._diff.get(id(call))
        if found is None:
            counts = _leaf_counts(call, self.outputs[s])
            pairs = [(k, j) for k, n in enumerate(counts) for j in range(n)]
            found = {pairs[pos]: i for i, pos in enumerate(call.diff_out)}
            self._diff[id(call)] = found
        return found


def _leaf_counts(call: GraphedCall, outputs: int) -> list[int]:
    """Tensors per output of ``call``: one output, or with several the
    items of the tuple it returns (as :class:`~.values.Flow` stores them)."""
    if outputs == 1:
        return [len(call.static_out)]
    out = call.rebuild(call.static_out)
    return [sum(isinstance(x, Tensor) for x in leaves(v)[0]) for v in out]

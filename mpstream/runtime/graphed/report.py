"""What a pipe's graphed stages report: which stages replay graphs, what
they hold, and the warning a stage that runs eagerly gives
(:meth:`mpstream.Pipe.graph_report`; filled by
:meth:`~.stages.StageGraphs.report`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["GraphReport", "GraphWarning", "StageReport"]


class GraphWarning(UserWarning):
    """A stage that was asked to be graphed runs eagerly."""


@dataclass
class StageReport:
    """What one stage replays: whether it is graphed (else ``reason``),
    its graphs (a forward, and a backward where gradients flow, per slot and
    signature) and ``passes`` (``weight`` too where a zero-bubble schedule
    splits the backward), the most slots a run used, its captures (of
    calls captured before and dropped, by a replaced tensor or with the
    stage's other graphs after one was dropped for room under
    ``max_calls`` or for reading a producer's call that was dropped:
    ``recaptures``), and the device memory its graphed calls hold, in
    three figures that do not overlap:

    - ``reserved_bytes``: its graphs' memory pools (every slot's
      activations, and the temporaries its graphs share); each call's own
      pool as measured when it was captured, the stage's shared pool as it
      is now; 0 off a GPU (the emulated backend has no pools).
    - ``static_bytes``: the buffers its calls allocated outside any pool,
      each storage counted once: static inputs copied into, the outputs a
      forward without gradients copies out, output gradients and input
      gradients. A producer's buffer that a call reads in place, or writes
      an input gradient into, is counted with the producing stage.
    - ``grad_bytes``: its gradient buffers (:class:`~.grads.GradStore`).

    Not counted anywhere: the pools of calls the stage dropped (for room,
    for reading a producer's call that was dropped, after a replaced
    tensor), which their graphs hold until every graph captured on the
    same stream is let go (:mod:`.lifetimes`); after a failed capture (the
    stage then runs eagerly and reports none of its calls), its former
    shared pool and its calls' pools, held likewise, and the failed graph's
    pool, which torch keeps for good; a producer's buffers still held by a
    reader's call that waits for its backward after the producer's call
    was dropped."""

    stage: int
    device: torch.device
    graphed: bool
    reason: str | None = None
    graphs: int = 0
    passes: tuple[str, ...] = ()
    slots: int = 0
    captures: int = 0
    recaptures: int = 0
    reserved_bytes: int = 0
    grad_bytes: int = 0
    static_bytes: int = 0


@dataclass
class GraphReport:
    """Which stages of a pipe replay graphs, what they hold, and how many
    graph launches (``replays``: passes replayed) they made so far."""

    stages: list[StageReport] = field(default_factory=list)
    replays: int = 0

    @property
    def graphs(self) -> int:
        """Graphs held by all stages."""
        return sum(s.graphs for s in self.stages)

    def __str__(self) -> str:
        lines = [
            f"{'stage':<6} {'device':<8} {'graphed':<8} {'graphs':<7} {'slots':<6} "
            f"{'passes':<24} {'reserved':>10} {'static':>10}  reason"
        ]
        for s in self.stages:
            passes = "+".join(s.passes) or "-"
            mib = f"{s.reserved_bytes / 2**20:.1f} MiB"
            static = f"{s.static_bytes / 2**20:.1f} MiB"
            lines.append(
                f"{s.stage:<6} {str(s.device):<8} {'yes' if s.graphed else 'no':<8} "
                f"{s.graphs:<7} {s.slots:<6} {passes:<24} {mib:>10} {static:>10}  "
                f"{s.reason or ''}".rstrip()
            )
        return "\n".join(lines)

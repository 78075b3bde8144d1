"""What graphed stages report: per stage, whether it replays graphs and what they hold.

:class:`GraphReport` is what ``Pipe.graph_report()`` returns, one
:class:`StageReport` per stage; :class:`GraphWarning` is the one warning a
stage that falls back to eager gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["GraphReport", "GraphWarning", "StageReport"]


class GraphWarning(UserWarning):
    """A stage that was asked to be graphed runs eagerly."""


@dataclass
class StageReport:
    """What one stage replays.

    Attributes:
        stage: its index.
        device: where it runs.
        graphed: whether its calls replay graphs (False: eager, see ``reason``).
        reason: why it runs eagerly, if it does.
        graphs: graphs held (a forward, and a backward where gradients flow,
            per slot and signature).
        passes: the passes replayed (``forward``, ``backward``, and
            ``weight`` where a zero-bubble schedule splits the backward).
        slots: the most slots a run has used.
        captures: calls captured so far (recaptures included).
        recaptures: captures caused by a replaced parameter, buffer or module.
        reserved_bytes: device memory reserved while capturing (its graphs'
            pools, activations of every slot included).
    """

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


@dataclass
class GraphReport:
    """Which stages of a pipe replay graphs, and what they hold."""

    stages: list[StageReport] = field(default_factory=list)

    @property
    def graphs(self) -> int:
        """Graphs held by all stages."""
        return sum(s.graphs for s in self.stages)

    def __str__(self) -> str:
        lines = [
            f"{'stage':<6} {'device':<8} {'graphed':<8} {'graphs':<7} {'slots':<6} "
            f"{'passes':<24} {'reserved':>8}  reason"
        ]
        for s in self.stages:
            passes = "+".join(s.passes) or "-"
            mib = f"{s.reserved_bytes / 2**20:.1f} MiB"
            lines.append(
                f"{s.stage:<6} {str(s.device):<8} {'yes' if s.graphed else 'no':<8} "
                f"{s.graphs:<7} {s.slots:<6} {passes:<24} {mib:>8}  {s.reason or ''}".rstrip()
            )
        return "\n".join(lines)

"""What a timeline says about the pipeline: :class:`Summary`.

:meth:`~mpstream.observe.timeline.Timeline.summary` computes it from a
measured or simulated timeline, run by run: the bubble per stage and per
device, the copy time hidden behind compute, each stage's busy time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Summary"]


@dataclass
class Summary:
    """What a timeline says about the pipeline, averaged over its runs.

    Attributes:
        makespan_ms: first start to last end of a run.
        bubble_fraction: share of stage-time (stages x makespan) in which a
            stage computed nothing.
        device_idle_fraction: share of device-time (devices x makespan) in
            which no stage on a device computed: the bubble as the schedule
            papers count it. Where several stages share a device
            (interleaved, V, or stages put on one GPU) a stage waits while
            its neighbours on the device compute, so ``bubble_fraction``
            counts their time as idle; this does not. With one stage per
            device the two are equal, as they are (1.0) in a run that
            computed nothing.
        copy_hidden_fraction: share of copy time during which a stage on the
            copy's source or destination device was computing (None without
            copies).
        stage_busy_ms: per stage, the time its compute stream was busy.
        runs: how many runs were averaged.
        per_run: the same numbers for each run.
    """

    makespan_ms: float
    bubble_fraction: float
    copy_hidden_fraction: float | None
    stage_busy_ms: list[float]
    runs: int
    per_run: list[dict[str, Any]] = field(default_factory=list)
    device_idle_fraction: float = 0.0
    devices: int = 0  # devices the stages computed on

    def __str__(self) -> str:
        hidden = (
            "-" if self.copy_hidden_fraction is None else f"{100 * self.copy_hidden_fraction:.1f}%"
        )
        lines = [
            f"runs: {self.runs}",
            f"makespan: {self.makespan_ms:.3f} ms",
            f"bubble fraction: {100 * self.bubble_fraction:.1f}%",
            *(
                [
                    f"device idle: {100 * self.device_idle_fraction:.1f}% "
                    f"({self.devices} device{'' if self.devices == 1 else 's'})"
                ]
                if self.shared_devices
                else []
            ),
            f"copy time hidden behind compute: {hidden}",
        ]
        for s, busy in enumerate(self.stage_busy_ms):
            share = busy / self.makespan_ms if self.makespan_ms > 0 else 0.0
            lines.append(f"stage {s} busy: {busy:.3f} ms ({100 * share:.1f}%)")
        return "\n".join(lines)

    @property
    def shared_devices(self) -> bool:
        """Whether stages shared a device (the two bubbles differ)."""
        return 0 < self.devices < len(self.stage_busy_ms)

    def bubble_text(self) -> str:
        """``'bubble 50%'``, with the device idle share where stages shared a device."""
        text = f"bubble {100 * self.bubble_fraction:.0f}%"
        if self.shared_devices:
            text += f" (device idle {100 * self.device_idle_fraction:.0f}%)"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "makespan_ms": self.makespan_ms,
            "bubble_fraction": self.bubble_fraction,
            "device_idle_fraction": self.device_idle_fraction,
            "devices": self.devices,
            "copy_hidden_fraction": self.copy_hidden_fraction,
            "stage_busy_ms": self.stage_busy_ms,
            "runs": self.runs,
            "per_run": self.per_run,
        }

"""Predictions for more devices: per-layer costs split into stages and simulated.

:func:`predict` takes each layer's cost for one micro-batch (and, where
known, the host's time to issue it), picks the balance that minimises the
slowest stage unless one is given, and simulates the step on ``stages``
devices with :func:`~mpstream.observe.cost_model.simulate`, against one device
running every layer. Nothing here is measured: label its figures as
predictions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .._words import count_of
from ..schedules import placement_of
from ..stages import partition, stage_costs
from .cost_args import Cost, backward_passes, check_listed, cost_pair, cost_size
from .cost_model import Simulation, simulate

__all__ = ["Prediction", "predict"]


@dataclass
class Prediction:
    """A pipeline on ``stages`` devices, predicted from per-layer costs."""

    stages: int
    balance: list[int]
    step_ms: float
    single_device_ms: float
    simulation: Simulation

    @property
    def speedup(self) -> float:
        # Nothing to run is as fast on one device as on many.
        return self.single_device_ms / self.step_ms if self.step_ms else 1.0


def predict(
    layer_times: Sequence[Cost],
    stages: int,
    chunks: int,
    *,
    copy_times: Cost | Sequence[Cost] | Mapping[tuple[int, int], Cost] = 0.0,
    balance: Sequence[int] | None = None,
    schedule: str = "gpipe",
    overlap: bool = True,
    issue_times: Sequence[Cost] | None = None,
    last_size: float = 1.0,
    input_device: str | torch.device | None = None,
) -> Prediction:
    """Predicts the step time of ``stages`` devices from per-layer costs.

    Args:
        layer_times: per layer, the cost of one micro-batch (forward,
            (forward, backward), (forward, input_grad, weight_grad) or
            (forward, input_grad, weight_grad, backward), as
            :func:`~mpstream.observe.cost_model.simulate` reads them), e.g.
            from :func:`mpstream.stages.balance.profile_layers`. Where any
            layer gives a triple or quadruple, each stage's split backward
            costs the sum of its layers' passes (a pair's backward counted
            as half each).
        stages: number of devices, one stage each.
        chunks: micro-batches per step (the last of ``last_size``).
        copy_times: per boundary (or one for all), or as
            :func:`~mpstream.observe.cost_model.simulate` takes a mapping:
            per (producer, receiving stage), ``(-1, 0)`` the batch's copy
            into the first stage (boundaries left out: free).
        balance: layers per stage; default the split that minimises the
            slowest stage.
        schedule: a schedule of one stage per device (``'gpipe'``,
            ``'1f1b'``, ``'zb_h1'``, ...).
        overlap: mpstream's streams or the default streams.
        issue_times: per layer, the host's time to issue it for one
            micro-batch: forward, (forward, backward), (forward,
            input_grad, weight_grad) or (forward, input_grad,
            weight_grad, backward), as ``layer_times``; a stage's tasks
            take the sum over its layers, and one host thread issues every
            task (a split backward's passes half the backward's each where
            a layer gives a pair). None: issuing is free.
        last_size: the last micro-batch's size relative to a full one, in
            (0, 1] (:func:`~mpstream.observe.cost_model.micro_batches` gives
            it for a batch the split size does not divide): its compute and
            copies cost that share.
        input_device: where the batch sits, as
            :func:`~mpstream.observe.cost_model.simulate` takes it: the
            stages' devices are ``'device0'``, ``'device1'``, ... (one per
            stage), any other label (``'cpu'``) is a device no stage is on;
            default the first stage's. Off the first stage's device, each
            micro-batch is copied in before its forward at the copy time (a
            per-boundary list of ``copy_times``: at nothing; a mapping: at
            its ``(-1, 0)`` entry), as
            ``simulate`` prices it.

    Returns:
        The prediction, with the single-device time for the speed-up: every
        layer on one device (the first stage's), no copies between layers,
        ``chunks`` micro-batches' work (the device time is taken as linear
        in the batch); with ``issue_times``, as one whole batch whose
        kernels are issued once, as the tutorial's single device runs it;
        with the batch off that device, after the whole batch's copy in
        (``chunks`` micro-batches' copies, none hidden).

    Raises:
        ValueError: a negative cost, ``layer_times`` a mapping, a
            ``balance`` that does not fit the layers, ``issue_times`` of
            another length than ``layer_times``, a schedule of several
            stages per device, or an empty ``input_device``.
        TypeError: ``input_device`` is not a label (a string or a
            ``torch.device``).
    """
    if placement_of(schedule) != "stage":
        raise ValueError(
            f"predict puts one stage on each device, and schedule={schedule!r} places several "
            f"stages per device: use mpstream.simulate with devices= or virtual_stages= for it"
        )
    check_listed(layer_times, "layer_times")
    pairs = [cost_pair(c, f"layer {i} time") for i, c in enumerate(layer_times)]
    totals = [f + b for f, b in pairs]
    chosen = list(balance) if balance is not None else partition(totals, stages)
    if balance is not None and (
        len(chosen) != stages or sum(chosen) != len(pairs) or min(chosen, default=0) < 1
    ):
        raise ValueError(
            f"balance {chosen} must give each of the {count_of(stages, 'stage')} at least one "
            f"layer and add up to the {count_of(len(pairs), 'layer')}"
        )
    forward = stage_costs([f for f, _ in pairs], chosen)
    backward = stage_costs([b for _, b in pairs], chosen)
    with_backward = any(b > 0 for b in backward)
    issue: dict[tuple[str, int], float] | None = None
    single_issue: dict[tuple[str, int], float] | None = None
    if issue_times is not None:
        if len(issue_times) != len(pairs):
            raise ValueError(
                f"issue_times needs {count_of(len(pairs), 'entry', 'entries')} (one per layer), "
                f"got {len(issue_times)}"
            )
        host = [cost_pair(c, f"layer {i} issue time") for i, c in enumerate(issue_times)]
        per_stage = zip(
            stage_costs([f for f, _ in host], chosen), stage_costs([b for _, b in host], chosen)
        )
        issue = {}
        for s, (f, b) in enumerate(per_stage):
            issue[("forward", s)], issue[("backward", s)] = f, b
        if any(cost_size(c) in (3, 4) for c in issue_times):
            # A split backward's passes take the layers' own issue times; a
            # whole one, where a layer gives a quadruple, its own.
            wholes = {k: v for k, v in issue.items() if k[0] == "backward"}
            passes = [backward_passes(c) for c in issue_times]
            inputs = stage_costs([b for b, _ in passes], chosen)
            weights = stage_costs([w for _, w in passes], chosen)
            for s, (b, w) in enumerate(zip(inputs, weights)):
                issue[("backward", s)], issue[("weight", s)] = b, w
            if any(cost_size(c) == 4 for c in issue_times):
                issue |= {("whole_backward", s): v for (_, s), v in wholes.items()}
        single_issue = {
            ("forward", 0): sum(f for f, _ in host),
            ("backward", 0): sum(b for _, b in host),
        }
    stage_times: list[Cost] = list(zip(forward, backward))
    if any(cost_size(c) in (3, 4) for c in layer_times):
        # A split schedule's B and W take the layers' own passes, not half
        # the stage's backward each (simulate's default for a pair).
        passes = [backward_passes(c) for c in layer_times]
        inputs = stage_costs([b for b, _ in passes], chosen)
        weights = stage_costs([w for _, w in passes], chosen)
        stage_times = list(zip(forward, inputs, weights))
        if any(cost_size(c) == 4 for c in layer_times):
            # A whole backward keeps the layers' whole ones (cost_pair's backward).
            stage_times = list(zip(forward, inputs, weights, backward))
    sim = simulate(
        stage_times,
        copy_times,
        chunks,
        schedule,
        overlap,
        backward=with_backward,
        issue_times=issue,
        last_size=last_size,
        input_device=input_device,
    )
    work = chunks - 1 + last_size  # full micro-batches' worth of examples
    # A batch off the first device: the single device copies it in whole
    # first, the pipeline's micro-batches' copies in as simulate priced them.
    copied = sum(s.duration_ms for s in sim.timeline.spans if s.stage == -1 and s.kind == "copy")
    if single_issue is None:
        single = copied + work * sum(totals)
    else:
        # The whole batch in one pass: the work of every micro-batch, but each
        # kernel issued once (issue time does not grow with the batch).
        whole = (work * sum(forward), work * sum(backward))
        single = simulate(
            [whole],
            copied,
            1,
            "gpipe",
            overlap,
            backward=with_backward,
            issue_times=single_issue,
            input_device=input_device if copied else None,
        ).step_ms
    return Prediction(stages, chosen, sim.step_ms, single, sim)

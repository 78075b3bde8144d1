"""Studies of the tutorial's model: a measured trace, the cost model checked
against measured steps, and the cost model's predictions for more devices.

These back ``mpstream trace`` and ``mpstream tune``; each returns plain
dicts ready for JSON.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn, optim

from ..observe.cost_model import Cost, micro_batches, simulate
from ..observe.fitting import fit
from ..observe.profiling import profile
from ..observe.scaling import predict
from ..pipe import Pipe
from ..runtime import synchronize
from ..stages import profile_layers
from . import loops
from . import models as tutorial
from .bench import Config

__all__ = [
    "TUTORIAL_SPLITS",
    "batch",
    "trace_tutorial",
    "validate_cost_model",
    "predict_scaling",
    "tutorial_factory",
    "resnet_stages",
]

# The tutorial's cut (layer2 | layer3) over resnet50_layers(), and its
# four-device analogue cutting at ResNet stage boundaries.
TUTORIAL_SPLITS = {2: [11, 12], 4: [7, 4, 6, 6]}


def batch(config: Config, device: torch.device) -> tuple[Tensor, Tensor]:
    """Random images and one-hot labels, as the tutorial's train loop makes them."""
    x = torch.randn(config.batch_size, 3, config.image_w, config.image_h, device=device)
    y = torch.zeros(config.batch_size, config.num_classes, device=device)
    y[
        torch.arange(config.batch_size), torch.randint(0, config.num_classes, (config.batch_size,))
    ] = 1
    return x, y


def _ordered(model: tutorial.StreamPipelineResNet50, order: Sequence[str]) -> Pipe:
    """The pipe of the tutorial's model, set to train in ``order``."""
    pipe: Pipe = model.__dict__["pipe"]
    pipe.schedule = tuple(order)
    return pipe


def trace_tutorial(
    dev0: torch.device,
    dev1: torch.device,
    config: Config,
    out: Path,
    *,
    plot: bool = True,
    order: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Profiles the tutorial's training loop through mpstream's drop-in:
    ``config.num_batches`` steps after ``config.warmup`` untimed ones.

    Writes ``trace.json`` (Chrome trace) and, with ``plot``, ``timeline.png``
    into ``out``.

    Args:
        dev0: the first half's device.
        dev1: the second half's device.
        config: the run's sizes.
        out: the output folder.
        plot: draw ``timeline.png``.
        order: an order of actions for the two stages: each step is then
            ``train_step`` in that order (the tutorial's MSE loss and SGD
            on one batch), not the tutorial's forward and backward, which
            runs fill-drain.

    Returns:
        The profile summary.
    """
    model = tutorial.StreamPipelineResNet50(dev0, dev1, config.split_size, config.num_classes)

    def train(num_batches: int) -> None:
        if order is None:
            loops.train(
                model,
                num_batches=num_batches,
                batch_size=config.batch_size,
                image_w=config.image_w,
                image_h=config.image_h,
                num_classes=config.num_classes,
                input_device=dev0,
            )
        else:
            pipe = _ordered(model, order)
            optimizer = optim.SGD(model.parameters(), lr=0.001)
            x, y = batch(config, dev0)
            for _ in range(num_batches):
                optimizer.zero_grad()
                pipe.train_step(x, y, nn.functional.mse_loss)
                optimizer.step()
        synchronize((dev0, dev1))

    if config.warmup:
        train(config.warmup)
    with profile(model) as prof:
        train(config.num_batches)
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(out / "trace.json")
    (out / "timeline.png").unlink(missing_ok=True)  # an earlier run's, beside this trace
    if plot:
        step = "tutorial training step" if order is None else "train_step in your order"
        n = config.num_batches
        steps = "the one step traced" if n == 1 else f"last of {n} steps"
        prof.plot(
            out / "timeline.png",
            title=f"{step} through mpstream on {dev0} | {dev1}, split size "
            f"{config.split_size}, {config.batch_size} images of {config.image_w}x"
            f"{config.image_h} ({steps}; numbers are micro-batches)",
        )
    return prof.summary(echo=False).to_dict()


def _step(model: nn.Module, x: Tensor, y: Tensor) -> None:
    torch.autograd.backward(nn.functional.mse_loss(model(x), y))
    model.zero_grad(set_to_none=True)


def _stepper(
    model: tutorial.StreamPipelineResNet50, x: Tensor, y: Tensor, order: Sequence[str] | None
) -> Callable[[], None]:
    """A training step of ``model`` (gradients dropped after): the tutorial's
    forward and backward, or ``train_step`` in ``order``."""
    if order is None:
        return lambda: _step(model, x, y)
    pipe = _ordered(model, order)

    def step() -> None:
        pipe.train_step(x, y, nn.functional.mse_loss)
        model.zero_grad(set_to_none=True)

    return step


def validate_cost_model(
    dev0: torch.device,
    dev1: torch.device,
    config: Config,
    split_sizes: Sequence[int],
    repeat: int = 3,
    order: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Fits the cost model to measured steps and compares its step time with them.

    For each split size: time ``repeat`` training steps (forward, MSE loss,
    backward; after ``config.warmup`` untimed ones) of the tutorial's model
    under :func:`~mpstream.profile`, fit per-task costs, simulate a step, and
    compare with the measured median. A batch the split size does not
    divide is fitted and simulated with its shorter last micro-batch.
    On a GPU the model is mpstream's streams with the measured host issue
    time of each task (``predicted_ms``; ``devices_only_ms`` without it); on
    the CPU, where every task runs on one host thread, one stream. With an
    ``order`` of actions, each step is ``train_step`` in that order, and
    that order is simulated (it covers one micro-batch count: give the
    split sizes that make it).
    """
    rows = []
    x, y = batch(config, dev0)
    y = y.to(dev1)
    for split in split_sizes:
        model = tutorial.StreamPipelineResNet50(dev0, dev1, split, config.num_classes)
        step = _stepper(model, x, y, order)
        for _ in range(config.warmup):
            step()
        synchronize((dev0, dev1))
        with profile(model) as prof:
            for _ in range(repeat):
                step()
                synchronize((dev0, dev1))
        micros, last = micro_batches(config.batch_size, split)
        costs = fit(prof, last)
        cuda = dev0.type == "cuda"
        devices = [str(dev0), str(dev1)] if cuda else ["host", "host"]
        issue = costs.issue_times if cuda and costs.issue_times else None
        sims = [
            simulate(
                costs.per_stage(),  # with its weight passes, where an order has them
                costs.copy_times,
                micros,
                "gpipe" if order is None else tuple(order),
                overlap=cuda,
                backward=True,
                devices=devices,
                issue_times=host,
                last_size=last,
            )
            for host in (issue, None)
        ]
        sim = sims[0]
        measured = statistics.median(r["makespan_ms"] for r in prof.summary(echo=False).per_run)
        rows.append(
            {
                "split_size": split,
                "micro_batches": micros,
                "measured_ms": measured,
                "predicted_ms": sim.step_ms,
                "error": (sim.step_ms - measured) / measured,
                "devices_only_ms": sims[1].step_ms,
                "stage_times_ms": costs.per_stage(),
                "copy_times_ms": costs.copy_times,
            }
        )
    return rows


def predict_scaling(
    device: torch.device,
    config: Config,
    device_counts: Sequence[int] = (2, 4),
    link_gbps: float = 50.0,
    input_device: torch.device | None = None,
) -> dict[str, Any]:
    """Predicts the tutorial model's step on ``p`` devices from one device's layer costs.

    Layers (the fc with ``config.num_classes`` outputs) are profiled on
    ``device`` with one micro-batch of ``config.split_size`` images; copies
    are estimated from the bytes at each cut over a ``link_gbps`` GB/s link.
    Each count gets the tutorial-style split (:data:`TUTORIAL_SPLITS`) and
    the time-balanced split. Everything here is a prediction of the cost
    model, not a measurement.

    ``input_device`` is where the batch sits (None, or ``device``: on the
    first stage's device, as the profiled device stands for it); elsewhere
    each micro-batch's images are copied into the first stage over the
    same link (:func:`~mpstream.observe.scaling.predict`'s
    ``input_device``), the single device copying the whole batch in first.
    """
    sample = torch.randn(config.split_size, 3, config.image_w, config.image_h)
    # The model the run measures: its fc's size is part of the step's cost.
    model = tutorial.single_device_resnet50("cpu", config.num_classes)
    profiles = profile_layers(tutorial.resnet50_layers(model), sample, device=device, repeat=3)
    layer_times = [(p.forward_ms, p.backward_ms) for p in profiles]
    micros, last = micro_batches(config.batch_size, config.split_size)
    # The batch elsewhere: a label no predicted stage's device has.
    source = None if input_device in (None, device) else str(input_device)
    copy_in = sample.nelement() * sample.element_size() / (link_gbps * 1e9) * 1e3
    rows = []
    for p in device_counts:
        for name, balance in (("tutorial-style", TUTORIAL_SPLITS.get(p)), ("balanced", None)):
            if name == "tutorial-style" and balance is None:
                continue
            base = predict(layer_times, p, micros, balance=balance, last_size=last)
            cuts = [sum(base.balance[: i + 1]) - 1 for i in range(p - 1)]
            copies = [profiles[c].output_bytes / (link_gbps * 1e9) * 1e3 for c in cuts]
            hops: dict[tuple[int, int], Cost] = {(s, s + 1): (c, c) for s, c in enumerate(copies)}
            if source is not None:
                hops[(-1, 0)] = (copy_in, 0.0)  # the images in; no gradient back
            pred = predict(
                layer_times, p, micros, balance=base.balance,
                copy_times=hops, last_size=last, input_device=source,
            )  # fmt: skip
            summary = pred.simulation.timeline.summary(echo=False)
            rows.append(
                {
                    "devices": p,
                    "split": name,
                    "balance": pred.balance,
                    "predicted_step_ms": pred.step_ms,
                    "single_device_ms": pred.single_device_ms,
                    "predicted_speedup": pred.speedup,
                    "bubble_fraction": summary.bubble_fraction,
                    "copy_ms": copies,
                }
            )
    return {
        "profiled_on": str(device),
        "micro_batch": config.split_size,
        "micro_batches": micros,
        "link_gbps_assumed": link_gbps,
        "input_device": str(input_device or device),
        "input_copy_ms": None if source is None else copy_in,
        "layer_ms": {p.name: [p.forward_ms, p.backward_ms] for p in profiles},
        "rows": rows,
    }


def tutorial_factory(dev0: torch.device, dev1: torch.device, config: Config) -> Any:
    """``factory(split_size, balance)`` building the tutorial ResNet50 as a 2-stage Pipe."""

    def build(split_size: int, balance: list[int] | None = None) -> Pipe:
        torch.manual_seed(0)
        return Pipe(
            tutorial.resnet50_layers(tutorial.single_device_resnet50("cpu", config.num_classes)),
            split_size=split_size,
            balance=balance or TUTORIAL_SPLITS[2],
            devices=[dev0, dev1],
        )

    return build


def resnet_stages(
    stages: int,
    micros: int,
    split_size: int,
    image_size: int,
    device: torch.device,
    balance: str = "tutorial",
) -> tuple[Pipe, Tensor, Tensor]:
    """The tutorial's ResNet50 as ``stages`` stages on ``device``, and a batch.

    With ``balance='tutorial'`` the split is the tutorial's for two stages,
    its ResNet-stage analogue for four (:data:`TUTORIAL_SPLITS`); otherwise
    (or with ``balance='time'``) ``balance_by_time``'s. The batch is
    ``micros`` micro-batches of ``split_size`` random images and one-hot
    labels, as the tutorial's train loop makes them.
    """
    from ..stages import balance_by_time

    torch.manual_seed(0)
    layers = tutorial.resnet50_layers()
    chosen = TUTORIAL_SPLITS.get(stages) if balance == "tutorial" else None
    chosen = chosen or balance_by_time(
        layers, torch.randn(split_size, 3, image_size, image_size), stages, device=device
    )
    pipe = Pipe(layers, chunks=micros, balance=chosen, devices=[device] * stages)
    batch = split_size * micros
    x = torch.randn(batch, 3, image_size, image_size, device=device)
    y = torch.zeros(batch, tutorial.NUM_CLASSES, device=device)
    y[torch.arange(batch), torch.randint(0, tutorial.NUM_CLASSES, (batch,))] = 1
    return pipe, x, y

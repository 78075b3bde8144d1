"""The tutorial's pipeline, and the single device, each step replayed as a CUDA graph.

On a fast GPU the tutorial's sizes are host-bound: one Python thread issues
ten micro-batches' kernels more slowly than the GPU runs them (H100: 225.7 ms
to issue a 225.8 ms step; graphed, the tutorial's ``train`` took 0.79x the
time of the single device run eagerly, docs/results/h100: not like with
like, :class:`GraphedSingleDevice` is the single device captured the same
way). :class:`GraphedPipelineResNet50`
is :class:`~mpstream.tutorial.StreamPipelineResNet50` trained through
:class:`~mpstream.CapturedStep`: the tutorial's ``train`` hands it each batch
(:meth:`fit_batch`), and the whole step (zero_grad, forward, backward, SGD
step) is captured once per batch shape and replayed. Both halves must sit on
one GPU (a graph cannot span devices); on the CPU each step runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn, optim

from .._warn import warn
from ..capture import CapturedStep
from ..pipe import Pipe
from . import rounds
from .models import (
    NUM_CLASSES,
    StreamPipelineResNet50,
    StreamPipelineResNet101,
    resnet50_layers,
    single_device,
)

__all__ = [
    "GraphedPipelineResNet50",
    "GraphedPipelineResNet101",
    "GraphedSingleDevice",
    "check_stages",
]


class _Graphed:
    """One :class:`CapturedStep` per batch shape, split size, learning rate
    and loss, sharing one graph memory pool."""

    __dict__: dict[str, Any]

    def fit_batch(
        self, inputs: Tensor, labels: Tensor, loss_fn: Callable[[Any, Any], Tensor], lr: float
    ) -> Tensor:
        """One training step (SGD at ``lr``, no momentum, as the tutorial's).

        The first batch of each shape, split size, learning rate and loss
        captures a step (warm-up included) that later ones replay; each is
        kept, so a changing ``lr`` captures (and keeps) a graph per value,
        and so does each new loss function object other than a loss module
        without tensors (warned once: create a lambda loss once, not per call).

        Args:
            inputs: images, anywhere (copied into the step's buffers).
            labels: targets for ``loss_fn``.
            loss_fn: the loss, e.g. the tutorial's ``nn.MSELoss()``.
            lr: SGD's learning rate.

        Returns:
            The batch's loss (a new tensor on the last stage's device).

        Raises:
            ValueError: the halves sit on two devices (one CUDA graph cannot
                span them), or what :class:`~mpstream.CapturedStep` refuses.
        """
        pipe: Pipe = self.pipe  # type: ignore[attr-defined]
        steps: dict[tuple[Any, ...], CapturedStep] = self.__dict__.setdefault("_steps", {})
        shapes = (tuple(inputs.shape), inputs.dtype, tuple(labels.shape), labels.dtype)
        # A graph keeps the micro-batching it was captured with.
        split = (pipe.split_size, pipe.chunks)
        key = (*shapes, split, lr, _loss_key(loss_fn))
        step = steps.get(key)
        if step is None:
            _warn_new_loss(self.__dict__, steps, key, loss_fn)
            # Plain SGD keeps no state, so a step per shape can have its own.
            shared = next((s.pool for s in steps.values() if s.captured), None)
            optimizer = optim.SGD(pipe.parameters(), lr=lr)
            step = CapturedStep(pipe, inputs, labels, loss_fn, optimizer=optimizer, pool=shared)
            steps[key] = step
        return step(inputs, labels)

    def __getstate__(self) -> dict[str, Any]:
        # Copies and pickles capture their own steps when they first train.
        state = dict(self.__dict__)
        state["_steps"] = {}
        state.pop("_warned_loss", None)
        return state


def _warn_new_loss(
    state: dict[str, Any],
    steps: dict[tuple[Any, ...], CapturedStep],
    key: tuple[Any, ...],
    loss_fn: Callable[[Any, Any], Tensor],
) -> None:
    """Warns once per model when only the loss function's object is new:
    each such object captures and keeps a step of its own (a lambda or
    ``functools.partial`` made per call grows memory every step)."""
    if state.get("_warned_loss") or isinstance(key[-1], tuple):
        return  # a loss module of other settings is another step, rightly
    if not any(k[:-1] == key[:-1] for k in steps):
        return
    state["_warned_loss"] = True
    name = getattr(loss_fn, "__qualname__", type(loss_fn).__qualname__)
    warn(
        f"fit_batch: the loss function object changed ({name}) for a batch shape, split "
        f"size and lr already captured: every new loss_fn object captures and keeps a step "
        f"of its own. Create the loss function once and pass that object on every call "
        f"(a loss module without tensors, such as nn.MSELoss(), may be made anew)"
    )


def _loss_key(loss_fn: Callable[[Any, Any], Tensor]) -> Any:
    """Equal for equally configured loss modules without tensors (the
    tutorial makes a new ``nn.MSELoss()`` per call); the object otherwise."""
    if isinstance(loss_fn, nn.Module) and not any(True for _ in loss_fn.state_dict()):
        plain = (str, int, float, bool, type(None))
        settings = sorted((k, v) for k, v in vars(loss_fn).items() if isinstance(v, plain))
        return (type(loss_fn), tuple(settings))
    return loss_fn


class GraphedPipelineResNet50(_Graphed, StreamPipelineResNet50):
    """The tutorial's split, pipelined by mpstream, each step a replayed CUDA graph."""


class GraphedPipelineResNet101(_Graphed, StreamPipelineResNet101):
    """IDRIS's ResNet-101 split, pipelined by mpstream, each step a replayed CUDA graph."""


class GraphedSingleDevice(_Graphed, nn.Module):
    """The single device's ResNet, each step a replayed CUDA graph: the
    baseline a graphed pipeline is compared with (like with like).

    The whole model is one stage of a :class:`~mpstream.Pipe` with one
    micro-batch, so its step is the single device's step, captured by
    :class:`~mpstream.CapturedStep` as the graphed pipeline's is.

    Args:
        arch: ``'resnet50'`` or ``'resnet101'``.
        device: where it runs.
        num_classes: classes of the head.
    """

    def __init__(
        self, arch: str, device: torch.device | str, num_classes: int = NUM_CLASSES
    ) -> None:
        super().__init__()
        layers = resnet50_layers(single_device(arch, device, num_classes))  # type: ignore[arg-type]
        self.pipe = Pipe(layers, chunks=1, balance=[len(layers)], devices=[device])

    def forward(self, x: Tensor) -> Tensor:
        out = self.pipe(x)
        assert isinstance(out, Tensor)
        return out


def check_stages(label: str, model: nn.Module) -> None:
    """Raises unless every stage of a graphed-stages model replays graphs.

    A stage whose capture failed runs eagerly (with a ``GraphWarning``): the
    model's time would not be a graphed step's.

    Args:
        label: the model's name, for the error.
        model: a :class:`~mpstream.tutorial.StreamPipelineResNet50` built
            with ``graphs=True`` (its pipe in ``__dict__["pipe"]``).

    Raises:
        rounds.NoRoom: a capture ran out of device memory (it may fit with
            fewer models held).
        RuntimeError: a capture failed for another reason.
    """
    pipe = model.__dict__.get("pipe")
    if pipe is None:
        return
    for stage in pipe.graph_report().stages:
        if stage.graphed:
            continue
        why = f"stage {stage.stage} runs eagerly ({stage.reason})"
        if rounds.says_out_of_memory(stage.reason or ""):  # the capture's error, in words
            raise rounds.NoRoom(why)
        raise RuntimeError(f"{label}: {why}; its time would not be a graphed step's")

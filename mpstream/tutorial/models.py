"""The tutorial's ResNet50 models, parametrised by devices.

"Single-Machine Model Parallel Best Practices" splits ResNet50 after
``layer2``: ``seq1`` (stem, layer1, layer2) on one device, ``seq2`` (layer3,
layer4, avgpool) and ``fc`` on the other. :class:`ModelParallelResNet50` and
:class:`PipelineParallelResNet50` reproduce its two models (the latter is the
default-stream baseline); :class:`StreamPipelineResNet50` is the same split
whose forward is mpstream's, the drop-in replacement.

IDRIS's version of the tutorial (the Jean Zay documentation) splits ResNet-101
at the same place with split size 8, and feeds it from a ``DataLoader`` with
pinned memory and ``non_blocking`` copies: the ``*ResNet101`` classes (its
loader and loop are in :mod:`.loops`, beside the tutorial's ``train``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torchvision.models.resnet import Bottleneck, ResNet

from ..pipe import Pipe
from ..stages import check_device_exists

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

__all__ = [
    "NUM_CLASSES",
    "ARCHS",
    "IDRIS_SPLIT_SIZE",
    "ModelParallelResNet50",
    "PipelineParallelResNet50",
    "StreamPipelineResNet50",
    "ModelParallelResNet101",
    "PipelineParallelResNet101",
    "StreamPipelineResNet101",
    "single_device_resnet50",
    "single_device_resnet101",
    "single_device",
    "resnet50_layers",
    "block_pipe",
]

NUM_CLASSES = 1000
# Bottleneck blocks per stage (layer1..layer4) of each architecture.
ARCHS = {"resnet50": (3, 4, 6, 3), "resnet101": (3, 4, 23, 3)}
# The split size of IDRIS's pipelined ResNet-101.
IDRIS_SPLIT_SIZE = 8
DeviceLike = str | torch.device


def _here(name: str, device: DeviceLike) -> torch.device:
    # Refused before any layer moves: torch's own error names no argument.
    return check_device_exists(torch.device(device), name)


class ModelParallelResNet50(ResNet):  # type: ignore[misc]
    """ResNet50 split over ``dev0`` (stem..layer2) and ``dev1`` (layer3..fc).

    Raises:
        ValueError: ``dev0`` or ``dev1`` names a device this machine lacks
            (``cuda:1`` with one GPU, ``cuda:0`` without CUDA), before any
            layer moves.
    """

    # Subclasses change the depth here; the split stays layer2 | layer3.
    BLOCKS: tuple[int, int, int, int] = ARCHS["resnet50"]  # type: ignore[assignment]

    def __init__(self, dev0: DeviceLike, dev1: DeviceLike, num_classes: int = NUM_CLASSES) -> None:
        here = _here("dev0", dev0), _here("dev1", dev1)
        super().__init__(Bottleneck, list(self.BLOCKS), num_classes=num_classes)
        self.dev0, self.dev1 = here
        self.seq1 = nn.Sequential(
            self.conv1, self.bn1, self.relu, self.maxpool, self.layer1, self.layer2
        ).to(self.dev0)
        self.seq2 = nn.Sequential(self.layer3, self.layer4, self.avgpool).to(self.dev1)
        self.fc.to(self.dev1)

    def head(self, x: Tensor) -> Tensor:
        """Second-device part: ``seq2`` then ``fc`` (the tutorial's flatten)."""
        x = self.seq2(x)
        return self.fc(x.view(x.size(0), -1))  # type: ignore[no-any-return]

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.seq1(x.to(self.dev0)).to(self.dev1))


class PipelineParallelResNet50(ModelParallelResNet50):
    """The tutorial's pipelined model: micro-batches on the default streams.

    Kept as the baseline mpstream is measured against. Every kernel and copy
    goes to the current stream of its device, so a micro-batch's copy to
    ``dev1`` cannot overlap the next micro-batch's compute on ``dev0``.
    """

    def __init__(
        self,
        dev0: DeviceLike,
        dev1: DeviceLike,
        split_size: int = 20,
        num_classes: int = NUM_CLASSES,
    ) -> None:
        super().__init__(dev0, dev1, num_classes)
        self.split_size = split_size

    def forward(self, x: Tensor) -> Tensor:
        splits = iter(torch.split(x.to(self.dev0), self.split_size, dim=0))
        s_next = next(splits)
        s_prev = self.seq1(s_next).to(self.dev1)
        ret = []
        for s_next in splits:
            ret.append(self.head(s_prev))  # runs on dev1 ...
            s_prev = self.seq1(s_next).to(self.dev1)  # ... while dev0 computes this
        ret.append(self.head(s_prev))
        return torch.cat(ret)


class _Head(nn.Module):
    """``seq2`` + flatten + ``fc`` as one pipeline stage (shares their modules)."""

    def __init__(self, seq2: nn.Module, fc: nn.Module) -> None:
        super().__init__()
        self.seq2 = seq2
        self.fc = fc

    def forward(self, x: Tensor) -> Tensor:
        x = self.seq2(x)
        return self.fc(x.view(x.size(0), -1))  # type: ignore[no-any-return]


class StreamPipelineResNet50(ModelParallelResNet50):
    """The tutorial's split, pipelined by :class:`mpstream.Pipe`.

    Same parameters and ``state_dict`` as :class:`ModelParallelResNet50`
    (weights load either way); the forward runs each device's half on its own
    stream and copies on copy streams, ordered by events. With ``graphs=True``
    each half replays its forward and backward from CUDA graphs
    (``Pipe(graphs=True)``).
    """

    def __init__(
        self,
        dev0: DeviceLike,
        dev1: DeviceLike,
        split_size: int = 20,
        num_classes: int = NUM_CLASSES,
        graphs: bool = False,
    ) -> None:
        super().__init__(dev0, dev1, num_classes)
        # Kept out of _modules so state_dict keys match the tutorial's model.
        self.__dict__["pipe"] = Pipe(
            nn.Sequential(self.seq1, _Head(self.seq2, self.fc)),
            split_size=split_size,
            graphs=graphs,
        )

    @property
    def split_size(self) -> int:
        """Micro-batch size."""
        size = self.__dict__["pipe"].split_size
        assert size is not None
        return int(size)

    @split_size.setter
    def split_size(self, value: int) -> None:
        self.__dict__["pipe"].split_size = value

    def forward(self, x: Tensor) -> Tensor:
        out = self.__dict__["pipe"](x)
        assert isinstance(out, Tensor)
        return out

    # The pipe sits outside _modules: what reaches the children reaches it here.
    def _apply(self, fn: Any, recurse: bool = True) -> Self:  # type: ignore[override]
        # The pipe first: it refuses a device move (both halves on one
        # device behind its back) before any tensor moves.
        pipe = self.__dict__.get("pipe")
        if pipe is not None:
            pipe._apply(fn, recurse)
        return super()._apply(fn, recurse)  # type: ignore[no-any-return]

    def train(self, mode: bool = True) -> Self:
        """Sets training mode on the layers and on the pipe that runs them."""
        super().train(mode)
        self.__dict__["pipe"].train(mode)
        return self


class ModelParallelResNet101(ModelParallelResNet50):
    """IDRIS's ResNet-101 split over ``dev0`` (stem..layer2) and ``dev1`` (layer3..fc)."""

    BLOCKS = ARCHS["resnet101"]  # type: ignore[assignment]


class PipelineParallelResNet101(PipelineParallelResNet50):
    """IDRIS's pipelined ResNet-101 (default streams, split size 8 by default)."""

    BLOCKS = ARCHS["resnet101"]  # type: ignore[assignment]

    def __init__(
        self,
        dev0: DeviceLike,
        dev1: DeviceLike,
        split_size: int = IDRIS_SPLIT_SIZE,
        num_classes: int = NUM_CLASSES,
    ) -> None:
        super().__init__(dev0, dev1, split_size, num_classes)


class StreamPipelineResNet101(StreamPipelineResNet50):
    """IDRIS's ResNet-101 split, pipelined by :class:`mpstream.Pipe`."""

    BLOCKS = ARCHS["resnet101"]  # type: ignore[assignment]

    def __init__(
        self,
        dev0: DeviceLike,
        dev1: DeviceLike,
        split_size: int = IDRIS_SPLIT_SIZE,
        num_classes: int = NUM_CLASSES,
        graphs: bool = False,
    ) -> None:
        super().__init__(dev0, dev1, split_size, num_classes, graphs)


def single_device_resnet50(device: DeviceLike, num_classes: int = NUM_CLASSES) -> nn.Module:
    """torchvision's ResNet50 on one device: the tutorial's reference."""
    return single_device("resnet50", device, num_classes)


def single_device_resnet101(device: DeviceLike, num_classes: int = NUM_CLASSES) -> nn.Module:
    """torchvision's ResNet-101 on one device: IDRIS's reference."""
    return single_device("resnet101", device, num_classes)


def single_device(arch: str, device: DeviceLike, num_classes: int = NUM_CLASSES) -> nn.Module:
    """torchvision's ``arch`` (a key of :data:`ARCHS`) on one device.

    Raises:
        ValueError: an unknown architecture, or a device this machine lacks.
    """
    from torchvision.models import resnet50, resnet101

    builders = {"resnet50": resnet50, "resnet101": resnet101}
    if arch not in builders:
        raise ValueError(f"unknown architecture {arch!r}; valid: {', '.join(builders)}")
    here = _here("device", device)
    model: nn.Module = builders[arch](num_classes=num_classes)
    return model.to(here)


def resnet50_layers(model: ResNet | None = None) -> nn.Sequential:
    """ResNet50 as a flat ``nn.Sequential`` of blocks, for ``balance=``.

    The stem (conv1, bn1, relu, maxpool), each Bottleneck block of layer1..4,
    avgpool, a flatten and fc: 23 layers sharing ``model``'s modules (a fresh
    torchvision ResNet50 when omitted), in the order ResNet.forward uses them.
    Layer names keep the original paths with dots replaced by underscores
    (``layer3_4``).
    """
    if model is None:
        from torchvision.models import resnet50

        model = resnet50(num_classes=NUM_CLASSES)
    layers: list[tuple[str, nn.Module]] = [
        ("conv1", model.conv1),
        ("bn1", model.bn1),
        ("relu", model.relu),
        ("maxpool", model.maxpool),
    ]
    for name in ("layer1", "layer2", "layer3", "layer4"):
        for i, block in enumerate(getattr(model, name)):
            layers.append((f"{name}_{i}", block))
    layers += [("avgpool", model.avgpool), ("flatten", nn.Flatten(1)), ("fc", model.fc)]
    return nn.Sequential(OrderedDict(layers))


def block_pipe(
    arch: str,
    dev0: DeviceLike,
    dev1: DeviceLike,
    split_size: int,
    num_classes: int = NUM_CLASSES,
    **options: object,
) -> Pipe:
    """``arch`` as a flat :class:`~mpstream.Pipe` of blocks, cut where the tutorial cuts.

    The layers of :func:`resnet50_layers` (which serves any torchvision
    ResNet), split after ``layer2`` as :class:`ModelParallelResNet50` splits
    them; ``options`` go to the Pipe (``schedule``, ``checkpoint``,
    ``force_copies``...).
    """
    layers = resnet50_layers(single_device(arch, "cpu", num_classes))  # type: ignore[arg-type]
    first = 4 + ARCHS[arch][0] + ARCHS[arch][1]  # the stem's 4 layers, layer1, layer2
    return Pipe(
        layers,
        split_size=split_size,
        balance=[first, len(layers) - first],
        devices=[dev0, dev1],
        **options,  # type: ignore[arg-type]
    )

"""The tutorial's training loop, and IDRIS's from a ``DataLoader``.

:func:`train` is the tutorial's ``train()``: MSELoss and SGD over random
images with one-hot labels, for any of :mod:`.models`' models (or a model
that takes each whole step itself, :mod:`.graphed`'s). IDRIS feeds its
ResNet-101 from a ``DataLoader`` of fake images with pinned memory and
``non_blocking`` copies: :func:`fake_loader` and :func:`train_from_loader`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn, optim
from torch.utils.data import DataLoader

from .models import NUM_CLASSES, DeviceLike

__all__ = ["train", "fake_loader", "train_from_loader"]


def train(
    model: nn.Module,
    *,
    num_batches: int = 3,
    batch_size: int = 120,
    image_w: int = 128,
    image_h: int = 128,
    num_classes: int = NUM_CLASSES,
    input_device: DeviceLike | None = None,
) -> Tensor:
    """The tutorial's training loop: MSELoss, SGD, random images, one-hot labels.

    Args:
        model: any of the tutorial's models (or a plain ResNet50). A model
            with a ``fit_batch(inputs, labels, loss_fn, lr)`` method
            (:mod:`mpstream.tutorial.graphed`) takes each whole step itself.
        num_batches: mini-batches per call.
        batch_size: images per mini-batch.
        image_w: image width.
        image_h: image height.
        num_classes: classes of the one-hot labels.
        input_device: where inputs are put before the forward; default the
            device of the model's first parameter.

    Returns:
        The last mini-batch's loss (not synchronised).
    """
    model.train(True)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(model.parameters(), lr=0.001)
    device = (
        torch.device(input_device) if input_device is not None else next(model.parameters()).device
    )
    one_hot_indices = torch.LongTensor(batch_size).random_(0, num_classes).view(batch_size, 1)
    loss = torch.zeros(())
    fit_batch = getattr(model, "fit_batch", None)
    for _ in range(num_batches):
        inputs = torch.randn(batch_size, 3, image_w, image_h)
        labels = torch.zeros(batch_size, num_classes).scatter_(1, one_hot_indices, 1)
        if fit_batch is not None:
            loss = fit_batch(inputs, labels, loss_fn, 0.001)
            continue
        optimizer.zero_grad()
        outputs = model(inputs.to(device))
        labels = labels.to(outputs.device)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
    return loss


def fake_loader(
    num_batches: int,
    batch_size: int,
    image_w: int,
    image_h: int,
    num_classes: int = NUM_CLASSES,
    *,
    workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader[tuple[Tensor, int]]:
    """A ``DataLoader`` over torchvision's ``FakeData``, as IDRIS feeds its model.

    The same ``num_batches`` batches of random images (integer labels) each
    epoch; ``pin_memory=True`` puts every batch in page-locked memory so
    ``non_blocking`` copies to the GPU are asynchronous.
    """
    from torchvision.datasets import FakeData
    from torchvision.transforms import ToTensor

    data = FakeData(
        size=num_batches * batch_size,
        image_size=(3, image_h, image_w),
        num_classes=num_classes,
        transform=ToTensor(),
    )
    return DataLoader(
        data,
        batch_size=batch_size,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
    )


def train_from_loader(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    optimizer: optim.Optimizer,
    input_device: DeviceLike | None,
) -> Tensor:
    """IDRIS's training loop: cross-entropy over (images, labels) batches.

    Args:
        model: any of the models here.
        batches: a :func:`fake_loader`, or batches already on the devices.
        optimizer: the model's optimizer.
        input_device: where images go with ``non_blocking=True`` before the
            forward; None hands the batch to the model where it is (a Pipe
            moves pinned host memory itself, on its io stream).

    Returns:
        The last batch's loss (not synchronised).
    """
    model.train(True)
    criterion = nn.CrossEntropyLoss()
    loss = torch.zeros(())
    for images, labels in batches:
        if input_device is not None:
            images = images.to(input_device, non_blocking=True)
        optimizer.zero_grad()
        outputs = model(images)
        loss = criterion(outputs, labels.to(outputs.device, non_blocking=True))
        loss.backward()
        optimizer.step()
    return loss

"""Shared by the in-place tests (test_inplace*.py): namedtuple batches, and
pipes of a module that must compute what the module does."""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from mpstream import Pipe
from tests.helpers import assert_same_grads

__all__ = ["Batch", "Odd", "trains_as_the_module", "runs_as_the_module"]


class Batch(NamedTuple):
    """A batch of two tensors, read by field."""

    x: Tensor
    y: Tensor


class Odd(NamedTuple):
    """Fields named as a tensor's attributes."""

    x: Tensor
    grad: Tensor
    shape: Tensor


def trains_as_the_module(model: nn.Module, batch: Any, tracer: str) -> tuple[Pipe, nn.Module]:
    """A 2-stage pipe of ``model`` (split at ``b``, 3 micro-batches of 7 rows)
    trains as ``model`` given a copy of ``batch``, and leaves ``batch`` as it was."""
    model = model.double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=3, split_points=["b"], devices=["cpu"] * 2, tracer=tracer)
    given = pytree.tree_map_only(Tensor, torch.clone, batch)
    y = torch.randn(7, 4, dtype=torch.float64)
    loss = pipe.train_step(batch, y, nn.functional.mse_loss)
    expected = nn.functional.mse_loss(ref(pytree.tree_map_only(Tensor, torch.clone, given)), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)
    torch.testing.assert_close(batch, given, rtol=0, atol=0)  # the caller's batch: left as it was
    return pipe, ref


def runs_as_the_module(model: nn.Module, batch: Any, tracer: str, leaves: Any = ()) -> None:
    """A 3-stage pipe of ``model`` (split at ``b`` and ``c``) computes what
    ``model`` does, given a copy of ``batch``, and its gradients."""
    model = model.double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=2, split_points=["b", "c"], devices=["cpu"] * 3, tracer=tracer,
                leaf_modules=leaves)  # fmt: skip
    out = pipe(pytree.tree_map_only(Tensor, torch.clone, batch))
    expected = ref(pytree.tree_map_only(Tensor, torch.clone, batch))
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_same_grads(pipe, ref)

"""A training step's snapshot of gradients (copied per stage in one
multi-tensor copy per dtype) and BatchNorm buffers (one per device and
dtype), put back as they were; a step failing as it takes its snapshot
leaves no save of the graphed stages' gradient buffers pending."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.pipe.snapshot import Norms, Snapshot
from mpstream.pipe.step import PipeStep
from mpstream.runtime.graphed import Emulated
from tests.helpers import Ops


def stage() -> tuple[nn.Module, list[nn.Parameter]]:
    """Parameters of two dtypes, one with a sparse gradient and one with none."""
    module = nn.ModuleList(
        [
            nn.Linear(3, 3).double(),
            nn.Linear(3, 2),
            nn.Embedding(5, 2, sparse=True),
            nn.Linear(2, 2),
        ]
    )
    params = list(module.parameters())
    for p in params[:-2]:
        p.grad = torch.randn_like(p)
    params[0].grad[0, 0] = -0.0  # type: ignore[index]
    params[0].grad[0, 1] = float("nan")  # type: ignore[index]
    module[2](torch.tensor([1, 3])).sum().backward()  # a sparse gradient
    return module, params


def test_a_stage_s_gradients_are_copied_once_per_dtype_and_put_back_as_they_were() -> None:
    module, params = stage()
    before = [None if p.grad is None else p.grad.clone() for p in params]
    tensors = [p.grad for p in params]
    snapshot = Snapshot(Norms(module), [params])
    with Ops() as seen:
        snapshot.save_grads(0)
    # float64, float32 and the sparse gradient's dtype (float32 too): no
    # clone, no copy per gradient.
    assert seen.ops["_foreach_copy_"] == 2 and seen.ops["clone"] == 0, seen.ops
    with torch.no_grad():
        for p in params:
            if p.grad is not None and not p.grad.is_sparse:
                p.grad.add_(1)
    params[-1].grad = torch.ones(2)
    snapshot.restore()
    for p, tensor, g in zip(params, tensors, before):
        if g is None:
            assert p.grad is None
            continue
        assert p.grad is tensor or g.is_sparse
        if g.is_sparse:
            torch.testing.assert_close(p.grad.to_dense(), g.to_dense())  # type: ignore[union-attr]
        else:
            # Bit for bit: -0.0 and NaN included.
            assert torch.equal(p.grad.view(torch.uint8), g.view(torch.uint8))  # type: ignore[union-attr]


def test_a_gradient_with_a_graph_is_copied_without_one() -> None:
    module, params = stage()
    params[0].grad = params[0].detach().clone().requires_grad_() * 2
    snapshot = Snapshot(Norms(module), [params])
    snapshot.save_grads(0)
    p, _, copy = snapshot.grads[id(params[0])]
    assert copy is not None and not copy.requires_grad and copy.grad_fn is None
    torch.testing.assert_close(copy, params[0].detach() * 2)


def test_a_parameter_of_the_stage_and_the_loss_is_saved_once() -> None:
    scale = nn.Linear(2, 2)
    for p in scale.parameters():
        p.grad = torch.ones_like(p)
    loss: Any = nn.ModuleDict({"scale": scale})
    snapshot = Snapshot(Norms(scale), [list(scale.parameters())], loss)
    with Ops() as seen:
        snapshot.save_grads(0)
    assert seen.ops["empty_like"] == 2 and len(snapshot.grads) == 2, seen.ops


def test_batchnorm_buffers_are_copied_once_per_dtype_and_put_back() -> None:
    # A list mixing the statistics' floats with the counters' int64 misses
    # the multi-tensor kernel: on a GPU, a launch per buffer at every step.
    module = nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3).double())
    norms = Norms(module)
    before = [b.clone() for b in norms.buffers]
    with Ops() as seen:
        norms.save()
    assert seen.ops["_foreach_copy_"] == 3, seen.ops  # float32, float64, int64
    assert all(len({b.dtype for b in buffers}) == 1 for _, buffers in norms.groups)
    with torch.no_grad():
        for b in norms.buffers:
            b.add_(1)
    norms.restore()
    for b, saved in zip(norms.buffers, before):
        assert torch.equal(b, saved)


@pytest.mark.parametrize("where", ["finding the norms", "copying the norms"])
def test_a_step_failing_as_it_takes_its_snapshot_leaves_no_graphs_save_pending(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # The graphed stages' gradient buffers were saved first: a failure after
    # (an interrupt, memory running out) left that save pending, a copy of
    # the buffers held and every store made by later runs saving its own,
    # until the next step.
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)).double()
    pipe = Pipe(model, chunks=2, balance=[2, 1], devices=["cpu", "cpu"], graphs=Emulated())
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    pipe.train_step(x, y, nn.MSELoss())  # captures; the gradients exist
    graphs = pipe._rt().worker.graphs
    assert graphs is not None

    def fail(*args: object) -> None:
        raise KeyboardInterrupt(where)

    if where == "finding the norms":
        monkeypatch.setattr(PipeStep, "_norms", fail)
    else:
        monkeypatch.setattr(Norms, "save", fail)
    with pytest.raises(KeyboardInterrupt, match=where):
        pipe.train_step(x, y, nn.MSELoss())
    stores = [st.store for st in graphs.stages if st.store is not None]
    assert stores and all(store._saved is None for store in stores)
    assert graphs._saved is None
    monkeypatch.undo()
    pipe.train_step(x, y, nn.MSELoss())

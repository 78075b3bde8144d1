"""Inputs a forward changes in place that share memory with other inputs."""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn

from mpstream import CapturedStep, Pipe
from mpstream.stages.shared_inputs import ChangedInputs
from tests.helpers import assert_same_grads


class ChangesX(nn.Module):
    """Changes ``x`` in place; stage 1 reads ``y`` after the change."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        x.mul_(2)
        return self.b(self.a(x)) + y.sum(1, keepdim=True)  # type: ignore[no-any-return]


class ChangesBatchX(nn.Module):
    """:class:`ChangesX` over a dict batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        batch["x"].mul_(2)
        return self.b(self.a(batch["x"])) + batch["y"].sum(1, keepdim=True)  # type: ignore[no-any-return]


class Batch(NamedTuple):
    x: Tensor
    y: Tensor


class ChangesFieldX(nn.Module):
    """:class:`ChangesX` over a namedtuple batch, its field read by index."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: Batch) -> Tensor:
        batch[0].mul_(2)
        return self.b(self.a(batch.x)) + batch.y.sum(1, keepdim=True)  # type: ignore[no-any-return]


def _pipe(model: nn.Module, tracer: str) -> tuple[Pipe, nn.Module]:
    model = model.double()
    ref = copy.deepcopy(model)
    return Pipe(model, chunks=3, split_points=["b"], devices=["cpu"] * 2, tracer=tracer), ref


def _call(model: type[nn.Module], t: Tensor, other: Tensor) -> tuple[Any, ...]:
    """The model's inputs: ``x`` is ``t``, ``y`` is ``other``."""
    if model is ChangesBatchX:
        return ({"x": t, "y": other},)
    if model is ChangesFieldX:
        return (Batch(t, other),)
    return (t, other)


# The module's y shows x's change; a pipeline's copy of x hid it (24 of 24
# elements differed), the error names both inputs.
CASES = [
    ("fx", ChangesX, "x", "y"),
    ("export", ChangesX, "x", "y"),
    ("fx", ChangesBatchX, r"batch\['x'\]", r"batch\['y'\]"),
    ("export", ChangesBatchX, r"batch\['x'\]", r"batch\['y'\]"),
    # A namedtuple's fields by name, as Python reads them (not batch['x']).
    ("fx", ChangesFieldX, r"batch\.x", r"batch\.y"),
    ("export", ChangesFieldX, r"batch\.x", r"batch\.y"),
]


@pytest.mark.parametrize(("tracer", "model", "changed", "other"), CASES)
@pytest.mark.parametrize("view", ["part", "same"])
def test_an_input_sharing_a_changed_input_s_memory_is_refused(
    tracer: str, model: type[nn.Module], changed: str, other: str, view: str
) -> None:
    pipe, ref = _pipe(model(), tracer)
    t = torch.randn(7, 4, dtype=torch.float64)
    before = t.clone()
    shared = t[:, :2] if view == "part" else t
    refused = f"changes input {changed} in place, and input {other} of the same call shares"
    with pytest.raises(ValueError, match=refused):
        pipe(*_call(model, t, shared))
    inputs = _call(model, t, shared)
    target = torch.zeros(7, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=refused):
        pipe.train_step(inputs if len(inputs) > 1 else inputs[0], target, nn.functional.mse_loss)
    torch.testing.assert_close(t, before, rtol=0, atol=0)  # refused before anything ran
    assert all(p.grad is None for p in pipe.parameters())
    # The next call, with a tensor of its own, computes what the module does.
    out = pipe(*_call(model, t.clone(), shared.clone()))
    expected = ref(*_call(model, t.clone(), shared.clone()))
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("layout", ["columns", "interleaved"])
def test_inputs_in_one_tensor_without_an_element_in_common_run(tracer: str, layout: str) -> None:
    # One storage, ranges overlapping (interleaved) or not: no element is
    # both, so the change of x shows in no y, in the module as in the pipe.
    pipe, ref = _pipe(ChangesX(), tracer)
    if layout == "columns":
        u = torch.randn(7, 8, dtype=torch.float64)
        x, y = u[:, :4], u[:, 4:]
    else:
        u = torch.randn(7, 4, 2, dtype=torch.float64)
        x, y = u[..., 0], u[..., 1]
    out = pipe(x, y)
    expected = ref(x.clone(), y.clone())
    torch.testing.assert_close(out, expected)


class ChangesLast(nn.Module):
    """Changes a tuple batch's last item, read by a negative index."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        batch[-1].mul_(2)
        return self.b(self.a(batch[0])) + batch[1].sum(1, keepdim=True)  # type: ignore[no-any-return]


def test_an_item_changed_by_a_negative_index_is_not_compared_with_itself() -> None:
    # batch[-1] is batch[1]: sharing no memory with batch[0], the call runs
    # (it was refused as batch[-1] sharing batch[1]'s memory).
    pipe, ref = _pipe(ChangesLast(), "fx")
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    torch.testing.assert_close(pipe((x, y)), ref((x, y.clone())))
    refused = r"changes input batch\[1\] in place, and input batch\[0\]"
    with pytest.raises(ValueError, match=refused):
        pipe((y, y))


def test_a_change_of_one_item_leaves_an_unchanged_item_sharing_memory_elsewhere() -> None:
    # Sharing between two inputs neither of which is changed is no concern.
    pipe, ref = _pipe(ChangesBatchX(), "fx")
    t = torch.randn(7, 4, dtype=torch.float64)
    x = torch.randn(7, 4, dtype=torch.float64)
    torch.testing.assert_close(pipe({"x": x, "y": t}), ref({"x": x.clone(), "y": t}))


def test_a_split_that_changes_no_input_checks_nothing() -> None:
    changed = ChangedInputs.of(["x"], {})
    t = torch.randn(3)
    changed.check("M", (t, t))  # no error


def test_a_path_into_a_tensor_is_the_tensor_itself() -> None:
    # ``x[0].mul_(2)`` on a tensor input: the path ends at x, not compared with itself.
    t = torch.randn(4, 3)
    ChangedInputs.of(["x", "y"], {0: ((0,),)}).check("M", (t, torch.randn(4, 3)))
    with pytest.raises(ValueError, match="changes input x in place, and input y"):
        ChangedInputs.of(["x", "y"], {0: ((0,),)}).check("M", (t, t[1:]))


def test_tensors_of_two_storages_over_one_memory_share() -> None:
    # Two storages over one memory (torch.frombuffer here; torch.from_numpy
    # of two views of one array alike): column 2 is in both.
    memory = bytearray(7 * 4 * 8)
    whole = torch.frombuffer(memory, dtype=torch.float64).view(7, 4)
    x = torch.frombuffer(memory, dtype=torch.float64, offset=2 * 8).as_strided((7, 2), (4, 1))
    y = torch.frombuffer(memory, dtype=torch.float64, offset=1 * 8).as_strided((7, 2), (4, 1))
    assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
    changes_x = ChangedInputs.of(["x", "y"], {0: ((),)})
    with pytest.raises(ValueError, match="changes input x in place, and input y"):
        changes_x.check("M", (x, y))
    # Apart by a column: no element in common.
    changes_x.check("M", (x, whole[:, :2]))


@pytest.mark.cuda
def test_the_check_of_device_inputs_never_waits_for_the_device() -> None:
    # Interleaved views of one device tensor: their elements are compared on
    # the CPU, without device memory or a synchronizing read of the result.
    u = torch.randn(64, 4, 2, device="cuda")
    changes_x = ChangedInputs.of(["x", "y"], {0: ((),)})
    torch.cuda.set_sync_debug_mode("error")
    try:
        changes_x.check("M", (u[..., 0], u[..., 1]))
        with pytest.raises(ValueError, match="changes input x in place"):
            changes_x.check("M", (u[..., 0], u[:, :2, 0]))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_captured_step_refuses_what_train_step_refuses() -> None:
    # Its static buffers are apart: the sharing of the caller's tensors went
    # unseen, and the step's loss was not the module's.
    pipe, ref = _pipe(ChangesX(), "fx")
    t = torch.randn(7, 4, dtype=torch.float64)
    target = torch.zeros(7, 4, dtype=torch.float64)
    step = CapturedStep(pipe, (t.clone(), t.clone()), target, nn.functional.mse_loss)
    with pytest.raises(ValueError, match="changes input x in place, and input y of the same"):
        step((t, t), target)
    assert all(p.grad is None for p in pipe.parameters())
    loss = step((t, t.clone()), target)
    torch.testing.assert_close(loss, nn.functional.mse_loss(ref(t.clone(), t), target))
    with pytest.raises(ValueError, match="changes input x in place, and input y of the same"):
        step((t, t[:, :4]), target)  # refused from the second call as from the first


class Halves(nn.Module):
    """Halves its input in place (a normalisation), then two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        x.div_(2)
        return self.b(self.a(x))  # type: ignore[no-any-return]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_target_sharing_a_changed_input_s_memory_is_refused(tracer: str) -> None:
    # An autoencoder's step, target = input: loss_fn(module(t), t) reads the
    # halved t; the pipeline's copy left the target whole (another loss).
    pipe, ref = _pipe(Halves(), tracer)
    t = torch.randn(7, 4, dtype=torch.float64)
    refused = "changes input x in place, and the target of the same call shares its memory"
    with pytest.raises(ValueError, match=refused):
        pipe.train_step(t, t, nn.functional.mse_loss)
    with pytest.raises(ValueError, match=refused):
        CapturedStep(pipe, t.clone(), t.clone(), nn.functional.mse_loss)(t, t)
    assert all(p.grad is None for p in pipe.parameters())
    loss = pipe.train_step(t, t.clone(), nn.functional.mse_loss)
    u = t.clone()
    torch.testing.assert_close(loss, nn.functional.mse_loss(ref(u), t))
    # Input and target apart in one batch tensor: no element in common.
    batch = torch.randn(7, 8, dtype=torch.float64)
    loss = pipe.train_step(batch[:, :4], batch[:, 4:], nn.functional.mse_loss)
    expected = nn.functional.mse_loss(ref(batch[:, :4].clone()), batch[:, 4:])
    torch.testing.assert_close(loss, expected)

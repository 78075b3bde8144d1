"""In-place changes across a split: a change through a view of another
stage's value, by either tracer, is refused at the split instead of giving
later stages (and the gradients) the value unchanged; an augmented
assignment changes a tensor in place, a number not (``check_in_place`` of
mpstream/stages/inplace_check.py, ``augmented`` of mpstream/stages/inplace.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from tests.helpers import assert_same_grads
from tests.stages.inplace_helpers import runs_as_the_module, trains_as_the_module


class ThroughView(nn.Module):
    """Stage 1 changes ``h``, made in stage 0, through a view; ``c`` reads it."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x) + 1.0
        g = self.b(h + 1.0)
        if self.how == "slice":
            h[:, :2].mul_(2)
        elif self.how == "view":
            h.view(-1).mul_(2)
        else:
            h[:, 0] = 0.0  # torch.fx cannot trace this: torch.export splits it
        return self.c(h) + g  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["slice", "view", "setitem"])
def test_a_change_through_a_view_another_stage_would_miss_is_refused(how: str) -> None:
    x = torch.randn(6, 4)
    with pytest.raises(ValueError, match="in stage 1 changes 'add' in place, which stage 2"):
        pipe = Pipe(ThroughView(how), chunks=2, split_points=["b", "c"], devices=["cpu"] * 3)
        pipe(x)  # a module split by torch.export is split at its first call


@pytest.mark.parametrize("how", ["slice", "setitem"])
def test_a_change_through_a_view_in_the_stage_that_makes_it_trains(how: str) -> None:
    model = ThroughView(how).double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=4, split_points=["c"], devices=["cpu"] * 2)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    expected = nn.functional.mse_loss(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)


class ApartView(nn.Module):
    """Stage 1 changes ``h``, made in stage 0, and reads ``v``, a view of
    ``h`` that stage 0 made and passes on its own (a copy of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(2, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        v = h[:, :2]
        g = self.b(x[:, :2])
        h.mul_(2)
        return g * self.b(v)  # type: ignore[no-any-return]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_change_the_same_stage_reads_through_a_view_passed_apart_is_refused(
    tracer: str,
) -> None:
    # With copies between the stages (as across devices) ``v`` reached stage 1 unchanged.
    with pytest.raises(ValueError, match=r"in stage 1 changes '\w+' in place, which stage 1"):
        pipe = Pipe(ApartView(), chunks=2, split_points=["b"], devices=["cpu"] * 2,
                    force_copies=True, tracer=tracer)  # fmt: skip
        pipe(torch.randn(6, 4))  # a module split by torch.export is split at its first call


class ViewAround(nn.Module):
    """Stage 1 changes ``h``, made in stage 0, in place; ``c`` in stage 2
    reads ``v``, a view of ``h`` taken where ``where`` says."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(2, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        v = h[:, :2] if self.where == "stage 0" else h
        g = self.b(x)
        v = h[:, :2] if self.where == "stage 1, before" else v
        h.mul_(2)
        v = h[:, :2] if self.where == "stage 1, after" else v
        y = self.c(g[:, 2:])
        v = h[:, :2] if self.where == "stage 2" else v
        return self.c(v) + y  # type: ignore[no-any-return]


@pytest.mark.parametrize(("tracer", "where"), [("fx", "stage 1, after"), ("fx", "stage 1, before"),
                                               ("export", "stage 1, before")])  # fmt: skip
def test_a_view_the_changing_stage_takes_carries_the_change(tracer: str, where: str) -> None:
    # It was refused ("stage 2 also reads 'a'"): stage 1 passes ``v`` changed.
    model = ViewAround(where).double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=2, split_points=["b", "c"], devices=["cpu"] * 3, tracer=tracer,
                force_copies=True)  # fmt: skip
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    expected = nn.functional.mse_loss(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize(("where", "reads"), [("stage 0", " through its view 'getitem'"),
                                              ("stage 2", "")])  # fmt: skip
def test_a_view_of_the_value_before_the_change_is_refused(where: str, reads: str) -> None:
    # Taken in stage 0, or in stage 2 of ``h`` as stage 0 passes it: unchanged.
    with pytest.raises(ValueError, match=f"'mul_' in stage 1 changes 'a' in place, which "
                                         f"stage 2 also reads{reads}:"):  # fmt: skip
        Pipe(ViewAround(where), chunks=2, split_points=["b", "c"], devices=["cpu"] * 3)


class ChangedAgain(nn.Module):
    """Stage 1 takes ``v`` of ``h`` and changes ``h``; stage 2 changes ``h``
    again, through the result of the first change, then reads ``v``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(2, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        g = self.b(x)
        v = h[:, :2]
        h *= 2
        y = self.c(g[:, 2:])
        h += 1
        return self.c(v) + y  # type: ignore[no-any-return]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_view_passed_before_a_later_change_of_the_changed_result_is_refused(tracer: str) -> None:
    # ``v`` carries stage 1's change of ``h``, not ``h += 1``, which changes ``h``
    # too: ``h *= 2``'s result is ``h``, not a value of its own.
    apart = r"in stage 2 changes '\w+' in place, which stage 2 also reads through '\w+', which"
    with pytest.raises(ValueError, match=apart):
        pipe = Pipe(ChangedAgain(), chunks=2, split_points=["b", "c"], devices=["cpu"] * 3,
                    tracer=tracer)  # fmt: skip
        pipe(torch.randn(6, 4))  # a module split by torch.export is split at its first call


class AugmentsInput(nn.Module):
    """``x += 1`` changes the input in place, so ``v``, a view of it taken before."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        v = x[:, :2]
        x += 1
        return self.b(self.a(torch.cat([v, x], 1)))  # type: ignore[no-any-return]


def test_an_augmented_assignment_to_an_input_changes_its_views() -> None:
    # Traced as ``x = x + 1`` for an input, ``v`` was left unchanged: another result.
    trains_as_the_module(AugmentsInput(), torch.randn(7, 4, dtype=torch.float64), "fx")


class ChangesInputLater(nn.Module):
    """Stage 1 changes the input in place; stages 0 and 2 read it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.b(self.a(x))
        x.mul_(2)
        return self.c(h) + x  # type: ignore[no-any-return]


def test_a_refused_change_of_an_input_names_the_input() -> None:
    # It named the copy copy_changed_inputs gives the input ('clone'), not the input.
    with pytest.raises(ValueError, match="'mul_' in stage 1 changes 'x' in place, which stage 2"):
        Pipe(ChangesInputLater(), chunks=2, split_points=["b", "c"], devices=["cpu"] * 3)


class CountsSizes(nn.Module):
    """Stage 1 adds to numbers read off a tensor's size; stage 2 reads their
    values from before (an augmented assignment to a number rebinds it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        n = x.size(1)
        width = x.shape[1] * 2
        m, w = n, width
        h = self.b(self.a(x))
        n += 1
        width -= 3
        return self.c(h * n * width) * m + w  # type: ignore[no-any-return]


def test_an_augmented_assignment_to_a_number_is_no_change_in_place() -> None:
    # It was refused as "'iadd' in stage 1 changes 'size' in place".
    model = CountsSizes().double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=2, split_points=["b", "c"], devices=["cpu"] * 3, tracer="fx")
    x = torch.randn(6, 4, dtype=torch.float64)
    out, expected = pipe(x), ref(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_same_grads(pipe, ref)


class AugmentsThroughAnAttribute(nn.Module):
    """``h = x.T; h += 1`` changes ``x`` (``h`` is a view of it), which a
    later stage reads: fx read ``x.T`` as an attribute with no ``+=``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.a(x)
        h = x.T
        h += 1
        return self.c(self.b(x))  # type: ignore[no-any-return]


def test_an_augmented_assignment_to_an_attribute_changes_its_tensor() -> None:
    runs_as_the_module(AugmentsThroughAnAttribute(), torch.randn(6, 4, dtype=torch.float64), "fx")


class CountsInItsMiddleStage(nn.Module):
    """Adds to its own buffer in stage 1 and reads it in stage 2."""

    calls: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        h = self.b(self.a(x))
        self.calls += 1
        return self.c(h) * self.calls  # type: ignore[no-any-return]


def test_a_buffer_changed_in_one_stage_and_read_in_a_later_one_is_refused_saying_why() -> None:
    # The message said stage 2 "would read it unchanged" and to make the
    # operation out of place: a buffer is no value a stage passes on, and
    # stage 2 reads the one tensor while stage 1 changes it.
    with pytest.raises(ValueError) as raised:
        Pipe(CountsInItsMiddleStage(), chunks=2, split_points=["b", "c"], devices=["cpu"] * 3,
             tracer="export", sample=torch.randn(4, 4))  # fmt: skip
    message = str(raised.value)
    assert "in stage 1 changes 'calls' in place, a tensor of the module's own" in message
    assert "which micro-batch's change stage 2 sees depends on timing" in message
    assert "unchanged" not in message and "inplace=False" not in message

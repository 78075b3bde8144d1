"""What a stage's shared memory pool may hold, proved on the CPU.

On a GPU a stage's whole backward graphs, and its forward graphs without
gradients, share one memory pool (:func:`~mpstream.runtime.graphed.backends.shares`):
a capture may take what another's freed, so such graphs may replay in any
order on the stage's stream only if nothing they allocate is needed after
their own replay. The emulation runs the same passes; here every tensor a
sharing pass allocates is followed, over every schedule, both loops and
checkpoint modes: none may outlive its replay (what does is written into
buffers allocated before capture). Passes that do keep what they allocate
(a forward's activations, a split B's junction gradients) take a pool of
their own per call.

A pipe given a backend object is copied and pickled like any other."""

from __future__ import annotations

import copy
import gc
import pickle
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mpstream.runtime.graphed import CudaGraphs, Emulated, GraphWarning
from mpstream.runtime.graphed.backends import shares
from mpstream.runtime.graphed.call import GraphedCall
from mpstream.runtime.graphed.grads import GradStore
from mpstream.schedules import SCHEDULES, placement_of
from tests.helpers import assert_same_grads, mlp
from tests.runtime.graphed.pairs import WIDTHS, data, pair


class Allocations(TorchDispatchMode):
    """Weak references to every tensor the operators dispatched return."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref[Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in ("detach", "view", "alias", "t", "transpose"):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and not any(t is a for a in tree_leaves(args)):
                    self.made.append(weakref.ref(t))
        return out


class Following(Emulated):
    """The emulation, checking that a sharing pass keeps nothing it made."""

    def __init__(self) -> None:
        super().__init__()
        self.checked: list[str] = []

    def replay(self, call: GraphedCall, name: str) -> None:
        if not shares(call, name):
            super().replay(call, name)
            return
        with Allocations() as seen:
            super().replay(call, name)
        alive = [r() for r in seen.made if r() is not None]
        assert not alive, f"{name} keeps {[tuple(t.shape) for t in alive]}"
        self.checked.append(name)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_what_a_pass_of_the_shared_pool_allocates_dies_with_its_replay(
    schedule: str, checkpoint: str
) -> None:
    extra: dict[str, Any] = (
        {"virtual_stages": 2, "balance": [2, 2, 2, 2], "devices": ["cpu"] * 4}
        if placement_of(schedule) != "stage"
        else {}
    )
    backend = Following()
    _, graphed = pair(
        mlp(WIDTHS), graphs=backend, split_size=3, schedule=schedule, checkpoint=checkpoint,
        **extra,
    )  # fmt: skip
    x, y = data()
    for _ in range(2):  # capture, then replay
        graphed.train_step(x, y, nn.MSELoss())
        nn.functional.mse_loss(graphed(x), y).backward()
        with torch.no_grad():
            graphed(x)
    assert "backward" in backend.checked and "forward" in backend.checked


def test_which_passes_share_the_pool() -> None:
    stage = mlp([4, 4])
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    store = GradStore(list(stage.parameters()))
    whole = GraphedCall(stage, (x,), stage, x.device, True, Emulated(), store)
    split = GraphedCall(stage, (x,), stage, x.device, True, Emulated(), store, split=True)
    with torch.no_grad():
        plain = GraphedCall(stage, (x,), stage, x.device, False, Emulated(), None)
    assert shares(whole, "backward") and not shares(whole, "forward")
    assert not shares(split, "backward") and not shares(split, "weight")
    assert shares(plain, "forward")


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise RuntimeError("no backward: a forward-only op")


class _Stage(nn.Module):
    def __init__(self, raises: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.raises = raises

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.raises:
            raise ValueError("the stage's own error")
        return _NoBackward.apply(self.lin(x))  # type: ignore[no-any-return]


def test_warm_up_marks_the_stages_forward_errors_only() -> None:
    # A forward error is the caller's to see; a backward the warm-up runs,
    # which the caller may never run (a forward with gradients enabled), is
    # the capture's: the stage then runs eagerly.
    from mpstream.runtime.graphed.backend import was_raised_eagerly
    from mpstream.runtime.graphed.backends import warm_up
    from mpstream.runtime.graphed.tied import TiedHooks

    x = torch.randn(2, 4)
    for raises, error, marked in ((True, ValueError, True), (False, RuntimeError, False)):
        stage = _Stage()
        store = GradStore(list(stage.parameters()), set(), TiedHooks())
        call = GraphedCall(stage, [x], stage, torch.device("cpu"), True, Emulated(), store)
        stage.raises = raises
        with pytest.raises(error) as info:
            warm_up(call, stage, 1, lambda: 0)
        assert was_raised_eagerly(info.value) is marked


@pytest.mark.parametrize("backend", [CudaGraphs, Emulated])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_pipe_given_a_backend_is_copied_and_pickled(backend: type, how: str) -> None:
    # The backend's lock is not copied: the copy takes its own, and
    # captures its own calls (on the CPU a CudaGraphs pipe runs eagerly).
    eager, graphed = pair(mlp(WIDTHS), graphs=backend(), chunks=2)
    x, y = data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphWarning)
        nn.functional.mse_loss(graphed(x), y).backward()
        twin = copy.deepcopy(graphed) if how == "deepcopy" else pickle.loads(pickle.dumps(graphed))
        for pipe in (eager, twin):
            pipe.zero_grad()
            nn.functional.mse_loss(pipe(x), y).backward()
    assert_same_grads(twin, eager)


def test_one_emulated_backend_given_pipe_after_pipe_keeps_no_dead_pipes_layers() -> None:
    # It kept each call's stage by the call's id() for good: every pipe it
    # had served stayed alive, parameters and all, for as long as it lived.
    backend = Emulated()
    x, y = data()
    layers = []
    for _ in range(3):
        eager, graphed = pair(mlp(WIDTHS), graphs=backend, chunks=2)
        graphed.train_step(x, y, nn.MSELoss())
        layers.append(weakref.ref(graphed[0]))
        del eager, graphed
    gc.collect()
    assert [ref() for ref in layers] == [None] * 3

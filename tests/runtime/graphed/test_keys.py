"""What graphs bake in: a stage's tensors and modules, noticed when they
change (cheaply: no walk over the stage per run); a call's key, strides
included; plain arguments' values, bounded."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mpstream.runtime.graphed import GraphWarning
from mpstream.runtime.graphed.keys import MAX_VALUES, Baked, autocast_key, generation, signature
from tests.helpers import assert_same_grads
from tests.models import Fan
from tests.runtime.graphed.test_stages import pair


def test_what_a_capture_baked_in_notices_what_a_replay_could_not() -> None:
    layer = nn.Linear(2, 2)
    baked = Baked(layer)
    with torch.no_grad():
        layer.weight.add_(1)  # in place: the graphs read it
    assert not baked.changed()
    layer.weight.data = layer.weight.data.clone()  # a new storage
    assert baked.changed()
    baked = Baked(layer)
    with torch.no_grad():
        layer.weight.t_()  # the same memory, laid out anew
    assert baked.changed()
    baked = Baked(layer)
    layer.bias.requires_grad_(False)
    assert baked.changed()
    baked = Baked(layer)
    layer.weight = nn.Parameter(layer.weight.detach())  # the same memory, a new parameter
    assert baked.changed()
    baked = Baked(layer)
    nn.Linear(2, 2)  # a module registering its own: nothing of this stage's
    assert not baked.changed()
    layer.extra = nn.Linear(2, 2)  # a module registered in the stage
    assert baked.changed()
    baked = Baked(layer)
    layer.register_buffer("scale", torch.ones(2))  # a buffer too
    assert baked.changed()
    baked = Baked(layer)
    layer.to(torch.float64)  # moved (parameters and buffers alike)
    assert baked.changed()


def test_a_run_walks_no_module_unless_something_registered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)]).double()
    _, graphed = pair(model, chunks=2, balance=[2, 2])
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    graphed.train_step(x, y, nn.MSELoss())  # captures (each way of calling: its own graphs)
    nn.functional.mse_loss(graphed(x), y).backward()
    walked: list[nn.Module] = []
    real = nn.Module.named_modules  # what modules() and parameters() walk

    def spy(self: nn.Module, *args: object, **kwargs: object) -> object:
        walked.append(self)
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(nn.Module, "named_modules", spy)
    before = generation()
    loss = nn.MSELoss()
    graphed.train_step(x, y, loss)
    nn.functional.mse_loss(graphed(x), y).backward()
    assert [m for m in walked if m is not loss] == [] and generation() == before


def test_the_key_holds_strides_not_storage_offsets() -> None:
    x = torch.randn(4, 6)
    assert signature((x,)) == signature((torch.randn(4, 6),))
    assert signature((x[1:3],)) == signature((x[2:4],))  # offsets: copied into the buffers
    assert signature((x.t().contiguous().t(),)) != signature((x,))  # strides: another layout
    assert signature((x,), [True]) != signature((x,), [False])


def test_an_input_of_another_layout_gets_graphs_of_its_own() -> None:
    eager, graphed = pair(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 4)).double(),
                          chunks=1, balance=[2, 1])  # fmt: skip
    x = torch.randn(6, 6, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), eager(x))
        before = graphed.graph_report().stages[0].captures
        strided = x.t().contiguous().t()  # equal values, column-major
        torch.testing.assert_close(graphed(strided), eager(strided))
    assert graphed.graph_report().stages[0].captures == before + 1


def test_a_plain_argument_taking_many_values_is_bounded_with_one_warning() -> None:
    eager, graphed = pair(
        Fan().double(), split_points=["a", "b", "c"], devices=["cpu"] * 4, balance=None, chunks=2
    )  # fmt: skip
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    scales = [1.0 + i / 10 for i in range(MAX_VALUES + 4)]
    with pytest.warns(
        GraphWarning, match=r"argument \d+ \(a float\) took more than 8 values.*tensor"
    ):
        for scale in scales:
            for pipe in (eager, graphed):
                pipe.zero_grad()
                nn.functional.mse_loss(pipe(x, scale), y).backward()
            assert_same_grads(graphed, eager)
    report = graphed.graph_report()
    assert all(s.graphed for s in report.stages)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphWarning)
        nn.functional.mse_loss(graphed(x, scales[0]), y).backward()  # a known value replays


def test_a_module_built_elsewhere_keeps_the_stages_graphs_and_gradient_buffers() -> None:
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)]).double()
    _, graphed = pair(model, chunks=2, balance=[2, 2])
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    graphed.train_step(x, y, nn.MSELoss())
    grads = [p.grad for p in graphed.parameters()]
    nn.Linear(3, 3)  # a metric, another model: registers its own parameters
    graphed.train_step(x, y, nn.MSELoss())
    assert all(p.grad is g for p, g in zip(graphed.parameters(), grads))
    assert [s.recaptures for s in graphed.graph_report().stages] == [0, 0]


def test_the_autocast_key_asks_no_device_while_autocast_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Read at every replayed forward: one call to torch says autocast is
    # off everywhere; asking CUDA's and the CPU's by name cost four times that.
    asked: list[str] = []
    real = torch.is_autocast_enabled

    def counted(device: str) -> bool:
        asked.append(device)
        return real(device)

    monkeypatch.setattr(torch, "is_autocast_enabled", counted)
    assert autocast_key() == ()
    assert asked == []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_key() == (("cpu", torch.bfloat16),)

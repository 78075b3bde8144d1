"""How the worker calls stages: a Chain spreads tuples, one-layer stages are
called directly unless that would skip a hook or a replaced forward."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.runtime.calls import Chain, StageCalls, spread_is_unsure, takes_several


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x * 2


class Add(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


class Whole(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return pair[0] - pair[1]


def test_a_tuple_is_spread_over_a_layer_taking_several_arguments() -> None:
    chain = Chain(OrderedDict([("pair", Pair()), ("add", Add())]))
    torch.testing.assert_close(chain(torch.ones(2)), torch.full((2,), 3.0))
    chain = Chain(OrderedDict([("pair", Pair()), ("whole", Whole())]))
    torch.testing.assert_close(chain(torch.ones(2)), torch.full((2,), -1.0))
    # Several inputs: spread over the first layer, or given whole as a tuple.
    torch.testing.assert_close(
        Chain(OrderedDict(add=Add()))(torch.ones(1), torch.ones(1)), torch.full((1,), 2.0)
    )
    whole = Chain(OrderedDict(whole=Whole()))
    torch.testing.assert_close(whole(torch.ones(1), torch.ones(1)), torch.zeros(1))
    assert takes_several(Add()) and not takes_several(nn.Linear(1, 1))


def test_one_layer_stages_are_called_directly_unless_that_changes_anything() -> None:
    block, add, pair = nn.Linear(2, 2), Add(), Pair()
    parts = [Chain(OrderedDict(block=block)), Chain(OrderedDict(add=add))]
    calls = StageCalls(parts)
    assert calls(1) == [block, parts[1]]  # Add spreads a tuple: keep the chain
    assert calls(2)[0] is parts[0]  # several inputs become one tuple
    two = Chain(OrderedDict([("pair", pair), ("whole", Whole())]))
    assert StageCalls([two])(1) == [two]
    hooked = Chain(OrderedDict(block=block))
    calls = StageCalls([hooked])
    assert calls(1) == [block]
    hooked.register_forward_hook(lambda *_: None)  # after the worker was built
    assert calls(1) == [hooked]


def test_a_hook_on_a_stage_still_runs() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), chunks=2)
    seen: list[int] = []
    pipe.partitions[1].register_forward_hook(lambda module, args, out: seen.append(len(out)))
    pipe(torch.randn(4, 2))
    assert seen == [2, 2]


def test_what_a_stage_call_does_is_kept() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), chunks=2)
    x = torch.randn(4, 2)
    pipe(x)
    # Hooks for every module see the stages as before.
    chains: list[nn.Module] = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, args, out: chains.append(module) if isinstance(module, Chain) else None
    )
    try:
        pipe(x)
    finally:
        handle.remove()
    assert len(chains) == 4
    # A forward replaced on a stage's instance runs.
    pipe.partitions[1].forward = lambda y: torch.zeros_like(y)
    assert (pipe(x) == 0).all()
    # A layer changed in place after the first run is the one called.
    del pipe.partitions[1].forward
    pipe.partitions[0][0].forward = lambda y: y
    torch.testing.assert_close(pipe(x), pipe.partitions[1](x))


def test_a_built_stage_keeps_its_layers() -> None:
    # The pipe holds the same layers as its own: one put into a stage would
    # run without being in the pipe's state_dict or parameters().
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)), balance=[2, 1])
    stage = pipe.partitions[0]
    changes = [
        lambda: stage.__setitem__(1, nn.ReLU()),
        lambda: stage.append(nn.ReLU()),
        lambda: stage.insert(0, nn.ReLU()),
        lambda: stage.pop(1),
        lambda: delattr(stage, "1"),
    ]
    for change in changes:
        with pytest.raises(TypeError, match="layer '.*' cannot be replaced, added or removed"):
            change()
    assert [type(m) for m in stage] == [nn.Linear, nn.Tanh]
    stage.train(False)  # settings other than layers change as for any module
    assert not stage.training and stage[0] is pipe[0]


class Mix(nn.Module):
    """torchgpipe style: the tuple whole, ``scale`` optional."""

    def forward(
        self, inputs: tuple[torch.Tensor, torch.Tensor], scale: float = 0.5
    ) -> torch.Tensor:
        x, y = inputs
        return x * scale + y


class Masked(nn.Module):
    """torch Pipe style: the values spread, ``mask`` optional."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return x if mask is None else x * mask


class MixWhole(nn.Module):
    def forward(
        self, inputs: tuple[torch.Tensor, torch.Tensor], *, scale: float = 0.5
    ) -> torch.Tensor:
        x, y = inputs
        return x * scale + y


def test_a_layer_where_sequential_and_torch_pipe_disagree_is_named_once() -> None:
    assert spread_is_unsure(Mix()) and spread_is_unsure(Masked())
    assert not spread_is_unsure(Add()) and not spread_is_unsure(MixWhole())
    assert not spread_is_unsure(nn.LSTM(2, 2))  # torch's own: (input, hx) spread, surely
    assert not spread_is_unsure(nn.TransformerEncoderLayer(4, 1))
    chain = Chain(OrderedDict([("pair", Pair()), ("masked", Masked())]))
    with pytest.warns(UserWarning, match=r"layer 'masked' \(Masked\) gets a tuple of 2 values"):
        torch.testing.assert_close(chain(torch.ones(2)), torch.full((2,), 2.0))  # spread
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chain(torch.ones(2))  # once per layer
    mix = Chain(OrderedDict([("pair", Pair()), ("mix", Mix())]))
    with pytest.warns(UserWarning, match="make the parameters after 'inputs' keyword-only"):
        mix(torch.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # keyword-only: the tuple whole, nothing to say
        whole = Chain(OrderedDict([("pair", Pair()), ("mix", MixWhole())]))
        torch.testing.assert_close(whole(torch.ones(2)), torch.full((2,), 2.5))


def test_a_spread_across_a_stage_boundary_is_named_too() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Pair(), Masked(), nn.Linear(4, 2))
    pipe = Pipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=2)
    with pytest.warns(UserWarning, match="layer '2' \\(Masked\\)"):
        pipe(torch.randn(4, 4))

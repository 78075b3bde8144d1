"""Splitting a Sequential into stages: both styles and every error."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from mpstream.partition import Chain, split_module, takes_several


def test_children_are_stages_and_keep_their_devices() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    stages = split_module(nn.Sequential(a, b))
    assert stages.devices == [torch.device("cpu")] * 2
    assert stages.balance == [1, 1]
    assert [list(p) for p in stages.partitions] == [[a], [b]]


def test_sequential_children_are_the_stages() -> None:
    inner = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    stages = split_module(nn.Sequential(inner, nn.Linear(2, 2)))
    assert list(stages.partitions[0]) == [inner]


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


def test_parameterless_children_inherit_a_neighbour_device() -> None:
    stages = split_module(nn.Sequential(nn.ReLU(), nn.Linear(2, 2), nn.Tanh()))
    assert stages.devices == [torch.device("cpu")] * 3


def test_balance_partitions_and_keeps_names() -> None:
    model = nn.Sequential(
        OrderedDict([("a", nn.Linear(2, 2)), ("b", nn.ReLU()), ("c", nn.Linear(2, 2))])
    )
    stages = split_module(model, balance=[2, 1], devices=["cpu", "cpu"])
    assert stages.balance == [2, 1]
    assert list(stages.partitions[0]._modules) == ["a", "b"]
    assert list(stages.partitions[1]._modules) == ["c"]
    assert [n for n, _ in stages.layers] == ["a", "b", "c"]


def test_devices_without_balance_place_each_child() -> None:
    stages = split_module(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), devices=["cpu", "cpu"])
    assert stages.balance == [1, 1]


def test_default_devices_without_cuda_are_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only default")
    stages = split_module(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), balance=[1, 1])
    assert stages.devices == [torch.device("cpu")] * 2


def test_not_a_sequential() -> None:
    with pytest.raises(TypeError, match="nn.Sequential whose children are the stages"):
        split_module(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="balance partitions an nn.Sequential"):
        split_module(nn.Linear(2, 2), balance=[1])


def test_same_child_twice() -> None:
    lin = nn.Linear(2, 2)
    model = nn.Sequential(OrderedDict([("first", lin), ("again", lin)]))
    with pytest.raises(ValueError, match="'first' and 'again' are the same module"):
        split_module(model)


def test_shared_parameters_across_layers() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    with pytest.raises(ValueError, match="share a parameter"):
        split_module(nn.Sequential(a, b))


def test_child_spanning_devices() -> None:
    child = nn.Module()
    child.register_parameter("w", nn.Parameter(torch.ones(1)))
    child.register_parameter("v", nn.Parameter(torch.ones(1, device="meta")))
    with pytest.raises(ValueError, match=r"stage 1 \('1'\) has parameters on several devices"):
        split_module(nn.Sequential(nn.Linear(1, 1), child))


def test_unsupported_device() -> None:
    with pytest.raises(ValueError, match="'cuda' and 'cpu'"):
        split_module(nn.Sequential(nn.Linear(1, 1, device="meta")))


def test_empty_sequential() -> None:
    with pytest.raises(ValueError, match="empty"):
        split_module(nn.Sequential())


@pytest.mark.parametrize(
    ("balance", "devices", "error", "match"),
    [
        ([1, 1], ["cpu", "cpu"], ValueError, "sums to 2 but the module has 3 layers"),
        ([0, 3], ["cpu", "cpu"], ValueError, r"balance\[0\] must be at least 1"),
        ([], [], ValueError, "balance is empty"),
        ("12", None, TypeError, "balance must be a list"),
        ([1.5, 1.5], None, TypeError, r"balance\[0\] must be an int"),
        ([2, 1], ["cpu"], ValueError, "devices has 1 entries but balance has 2 stages"),
        ([2, 1], "cpu", TypeError, "one device per stage"),
    ],
)
def test_bad_balance_or_devices(balance: object, devices: object, error: type, match: str) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(error, match=match):
        split_module(model, balance=balance, devices=devices)  # type: ignore[arg-type]


def test_devices_count_must_match_children() -> None:
    with pytest.raises(ValueError, match="the module has 2 stages"):
        split_module(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), devices=["cpu"])

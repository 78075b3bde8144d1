"""Splitting a Sequential into stages: both styles and every error."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.stages.sequential import check_devices_exist, check_shared, split_module
from tests.helpers import assert_same_grads, mlp


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


class TwoParts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.head = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def test_not_a_sequential() -> None:
    with pytest.raises(TypeError, match="got Linear, not an nn.Sequential, and no split_points"):
        split_module(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="balance= layer counts partition an nn.Sequential"):
        split_module(nn.Linear(2, 2), balance=[1])


@pytest.mark.parametrize("balance", [None, [1, 1]])
def test_a_module_that_is_not_a_sequential_is_pointed_to_split_points(
    balance: list[int] | None,
) -> None:
    # The message names the module, its children and a split point that works.
    with pytest.raises(TypeError, match="got TwoParts") as info:
        Pipe(TwoParts(), chunks=2, balance=balance, devices=["cpu", "cpu"])
    message = str(info.value)
    assert "TwoParts's children: encoder, head; e.g. split_points=['head']" in message
    assert "balance='time' or 'size' with devices= and sample=" in message
    pipe = Pipe(TwoParts(), chunks=2, split_points=["head"], devices=["cpu", "cpu"])
    assert pipe(torch.randn(4, 2)).shape == (4, 2)


def test_same_child_twice() -> None:
    lin = nn.Linear(2, 2)
    model = nn.Sequential(OrderedDict([("first", lin), ("again", lin)]))
    with pytest.raises(ValueError, match="'first' and 'again' are the same module"):
        split_module(model)


def test_shared_parameters_on_one_device_are_allowed() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    assert split_module(nn.Sequential(a, b)).balance == [1, 1]
    assert split_module(nn.Sequential(a, b), balance=[1, 1], devices=["cpu", "cpu"]).balance


def tied(what: str) -> nn.Sequential:
    a, b = nn.Linear(2, 2), nn.BatchNorm1d(2)
    c, d = nn.Linear(2, 2), nn.BatchNorm1d(2)
    if what == "parameter":
        c.weight = a.weight
    else:
        d.register_buffer("running_mean", b.running_mean)
    return nn.Sequential(OrderedDict([("a", a), ("b", b), ("c", c), ("d", d)]))


@pytest.mark.parametrize(
    ("what", "first", "second"), [("parameter", "a", "c"), ("buffer", "b", "d")]
)
def test_shared_tensor_across_devices_is_named(what: str, first: str, second: str) -> None:
    model = tied(what)
    layers = list(model.named_children())
    devices = [torch.device("cpu"), torch.device("cuda", 1)]
    tail = "weight" if what == "parameter" else "running_mean"
    match = (
        rf"{what} '{first}\.{tail}' \(stage 0, cpu\) is shared with '{second}\.{tail}' "
        rf"\(stage 1, cuda:1\); layers on different devices cannot share a {what}"
    )
    with pytest.raises(ValueError, match=match):
        check_shared(layers, [2, 2], devices)
    check_shared(layers, [2, 2], devices[:1] * 2)
    check_shared(layers, [4], devices[:1])


def test_pipe_rejects_tied_weights_across_devices_before_moving_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Pretend two GPUs exist: the check must come before any layer moves.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    model = tied("parameter")
    with pytest.raises(ValueError, match=r"'a\.weight' \(stage 0, cuda:0\) is shared with"):
        Pipe(model, balance=[2, 2], devices=["cuda:0", "cuda:1"])
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize(
    ("count", "devices", "match"),
    [
        (
            0,
            ["cpu", "cuda:0"],
            "stage 1 is on cuda:0, but CUDA is not available here; available devices: cpu$",
        ),
        (0, ["cuda"], "stage 0 is on cuda, but CUDA is not available"),
        (
            1,
            ["cuda:0", "cuda:1"],
            r"stage 1 is on cuda:1, but only 1 CUDA device\(s\) exist "
            "here; available devices: cpu, cuda:0$",
        ),
    ],
)
def test_devices_that_do_not_exist_fail_at_construction(
    monkeypatch: pytest.MonkeyPatch, count: int, devices: list[str], match: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ValueError, match=match):
        check_devices_exist([torch.device(d) for d in devices])
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in devices])
    with pytest.raises(ValueError, match=match):  # balance + devices
        Pipe(model, balance=[1] * len(devices), devices=devices)
    with pytest.raises(ValueError, match=match):  # one device per child
        Pipe(model, devices=devices)
    assert all(p.device.type == "cpu" for p in model.parameters())


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
        ([2, 1], ["cpu"], ValueError, "devices has 1 entry but balance has 2 stages"),
        ([2, 1], "cpu", TypeError, "one device per stage"),
        (
            None,
            ["cpu", "cpu"],
            ValueError,
            r"devices has 2 entries but the module has 3 layers, and without balance= each "
            r"layer is a stage: give balance= \(layers per stage, e.g. balance=\[2, 1\]\) to "
            r"group them into 2 stages, or give one device per layer$",
        ),
        (
            None,
            ["cpu"] * 4,
            ValueError,
            r"devices has 4 entries but the module has 3 layers, and without balance= each "
            r"layer is a stage: give one device per layer$",
        ),
        (None, "cpu", TypeError, "one device per stage"),
    ],
)
def test_bad_balance_or_devices(balance: object, devices: object, error: type, match: str) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(error, match=match):
        split_module(model, balance=balance, devices=devices)  # type: ignore[arg-type]


def test_devices_count_must_match_children() -> None:
    with pytest.raises(ValueError, match="the module has 2 layers, and without balance= each"):
        split_module(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), devices=["cpu"])


@pytest.mark.parametrize("typo", ["cuda:O", "CPU", "cuda1", 3.5])
def test_a_device_that_is_not_one_is_named_with_its_stage(typo: object) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"devices\[1\] \(stage 1\) is .*, not a device \("):
        Pipe(model, balance=[1, 1], devices=["cpu", typo])  # type: ignore[list-item]


def test_numpy_integer_counts_are_taken_as_ints() -> None:
    # balance, chunks and virtual_stages computed with numpy (np.diff of
    # cut points, say), as Schedule and record_plan take them; not bools.
    np = pytest.importorskip("numpy")
    model = mlp([3, 3, 3, 3, 3])
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    plain = copy.deepcopy(model)
    loss = nn.functional.mse_loss(plain(x), y)
    loss.backward()
    for balance in ([np.int64(2)] * 4, np.array([2, 2, 2, 2]), torch.tensor([2, 2, 2, 2])):
        pipe = Pipe(copy.deepcopy(model), chunks=np.int32(3), balance=balance,
                    devices=["cpu"] * 4, schedule="looped_bfs",
                    virtual_stages=np.int64(2))  # type: ignore[arg-type]  # fmt: skip
        assert pipe.balance == [2, 2, 2, 2] and all(type(b) is int for b in pipe.balance)
        torch.testing.assert_close(pipe.train_step(x, y, nn.MSELoss()), loss.detach())
        assert_same_grads(pipe, plain)
    with pytest.raises(TypeError, match=r"balance\[0\] must be an int, got bool"):
        split_module(model, balance=[True, 3, 4], devices=["cpu"] * 3)

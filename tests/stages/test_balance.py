"""Automatic balancing: exact partitions, profiling, and Pipe(balance='time'|'size')."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from mpstream import NoChunk, Pipe
from mpstream.stages.balance import balance_by_size, balance_by_time, profile_layers, profile_units


class Slow(nn.Module):
    def __init__(self, ms: float) -> None:
        super().__init__()
        self.ms = ms
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.ms / 1e3)
        return self.lin(x)


def test_balance_by_time_isolates_the_slow_layer() -> None:
    model = nn.Sequential(Slow(1), Slow(1), Slow(1), Slow(40), Slow(1), Slow(1))
    assert balance_by_time(model, torch.randn(2, 4), 3, repeat=2) == [3, 1, 2]


def test_balance_by_size_follows_parameters() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 512), nn.Linear(512, 4))
    assert balance_by_size(model, torch.randn(2, 4), 2) == [3, 1]


def test_profile_leaves_the_module_alone_and_handles_in_place_layers() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    profiles = profile_layers(model, torch.randn(3, 4), repeat=1)
    assert [p.name for p in profiles] == ["0", "1", "2"]
    assert all(p.time_ms >= 0 and p.activation_bytes > 0 for p in profiles)
    assert profiles[1].parameter_bytes == 0 and profiles[0].parameter_bytes == 2 * (16 + 4) * 4
    assert all(p.grad is None for p in model.parameters())
    for a, b in zip(model.parameters(), before):
        torch.testing.assert_close(a, b)
    with pytest.raises(TypeError, match="nn.Sequential"):
        profile_layers(nn.Linear(2, 2), torch.randn(1, 2))


@pytest.mark.parametrize("how", ["time", "size"])
def test_pipe_balances_automatically(how: str) -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    pipe = Pipe(
        model, chunks=2, balance=how, devices=["cpu", "cpu", "cpu"], sample=torch.randn(4, 8)
    )
    assert sum(pipe.balance) == 6 and len(pipe.balance) == 3
    assert pipe(torch.randn(4, 8)).shape == (4, 8)


def test_pipe_auto_balance_errors() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="needs sample="):
        Pipe(model, balance="time", devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="needs devices="):
        Pipe(model, balance="size", sample=torch.randn(1, 2))
    with pytest.raises(ValueError, match="'time' or 'size'"):
        Pipe(model, balance="speed", devices=["cpu", "cpu"], sample=torch.randn(1, 2))


def test_balance_by_size_counts_optimizer_state_with_param_scale() -> None:
    # Activations (three Tanh) against parameters (two Linear): Adam's two
    # moments per parameter byte move a Linear to the first stage.
    model = nn.Sequential(nn.Tanh(), nn.Tanh(), nn.Tanh(), nn.Linear(64, 64), nn.Linear(64, 64))
    sample = torch.randn(64, 64)
    assert balance_by_size(model, sample, 2) == [3, 2]
    assert balance_by_size(model, sample, 2, param_scale=2) == [4, 1]
    (lin,) = profile_layers(model[3:4], sample, repeat=1)
    assert lin.training_bytes(2) == lin.size_bytes + lin.parameter_bytes
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="param_scale must be a finite number >= 0"):
            balance_by_size(model, sample, 2, param_scale=bad)


def test_a_tied_weight_is_counted_once() -> None:
    first, second = nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False)
    second.weight = first.weight  # held once on the device, used by both layers
    profiles = profile_layers(nn.Sequential(first, nn.Tanh(), second), torch.randn(4, 32), repeat=1)
    weight = 2 * first.weight.numel() * first.weight.element_size()  # itself and its gradient
    assert [p.parameter_bytes for p in profiles] == [weight, 0, 0]


class Modes(nn.Module):
    """Records the mode of every call (on the class: profiling deep-copies)."""

    seen: list[bool] = []

    def forward(self, x: Tensor) -> Tensor:
        Modes.seen.append(self.training)
        return x


def test_profiling_runs_in_training_mode_and_leaves_the_mode_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Modes(), nn.Dropout(0.5)).eval()
    Modes.seen.clear()
    profiles = profile_layers(model, torch.randn(8, 4), repeat=1)
    assert Modes.seen == [True, True]  # warm-up and one timed run
    assert profiles[2].activation_bytes > profiles[2].output_bytes  # dropout saved its mask
    assert not any(m.training for m in model.modules())


class _Two(nn.Module):
    """Takes two inputs (a tuple reaching it is spread, as in the pipe)."""

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return a + b


class _Named(nn.Module):
    def forward(self, x: Tensor) -> dict[str, object]:
        return {"h": x * 2, "tag": "plain"}


class _Reads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, d: dict[str, Tensor]) -> Tensor:
        return self.lin(d["h"])


@pytest.mark.parametrize("how", ["time", "size"])
def test_balancing_calls_layers_as_the_pipe_does(how: str) -> None:
    a, b = torch.randn(6, 8), torch.randn(6, 8)
    several = nn.Sequential(_Two(), nn.Linear(8, 8), nn.ReLU())
    pipe = Pipe(several, chunks=2, balance=how, sample=(a[:2], b[:2]), devices=["cpu"] * 2)
    torch.testing.assert_close(pipe(a, b), several[2](several[1](a + b)))
    plain = nn.Sequential(nn.Linear(8, 8), _Named(), _Reads())
    pipe = Pipe(plain, chunks=2, balance=how, sample=a[:2], devices=["cpu"] * 2)
    torch.testing.assert_close(pipe(a), plain(a))


def test_balancing_errors_name_the_argument_the_layer_and_torchgpipe_s_order() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(5, 2))
    with pytest.raises(TypeError, match=r"torchgpipe's argument order, \(partitions, module"):
        balance_by_time(2, model, torch.randn(3, 4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device is 'cpuu', not a device"):
        balance_by_size(model, torch.randn(3, 4), 2, device="cpuu")
    # A module that is not a Sequential is balanced by the Pipe: say so.
    with pytest.raises(TypeError, match=r"got Linear; .*Pipe\(module, balance='time' or 'size'"):
        balance_by_time(nn.Linear(4, 4), torch.randn(3, 4), 2)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        balance_by_time(model, torch.randn(3, 4), 2)
    assert "profiling layer 2 ('2') to balance the stages" in "".join(info.value.__notes__)


class TwoBlocks(nn.Module):
    """Not a Sequential: balance='time' picks its split points by tracing."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("module", [lambda: nn.Sequential(nn.Linear(2, 2)), TwoBlocks])
@pytest.mark.parametrize("how", ["time", "size"])
def test_auto_balance_checks_the_devices_before_profiling_on_them(
    module: type[nn.Module], how: str
) -> None:
    # Each device of the list makes a stage: a string is not a list of
    # devices (len('cpu') would ask for 3 stages, torch.device('c') fail),
    # and a device that is not one is named with its stage, before the
    # module is profiled on the first.
    sample = torch.randn(2, 2)
    with pytest.raises(TypeError, match="devices must be a list with one device per stage"):
        Pipe(module(), balance=how, devices="cpu", sample=sample)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"devices\[0\] \(stage 0\) is 'cpux', not a device"):
        Pipe(module(), balance=how, devices=["cpux", "cpu"], sample=sample)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="stage 0 is on cuda:0, but CUDA is not available"):
            Pipe(module(), balance=how, devices=["cuda:0", "cpu"], sample=sample)


@pytest.mark.parametrize("how", ["time", "size"])
def test_auto_balance_with_more_devices_than_layers_names_devices(how: str) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    message = rf"balance='{how}' gives each of the 3 devices \(devices=\) a stage .* 2 layer"
    with pytest.raises(ValueError, match=message):
        Pipe(model, balance=how, devices=["cpu"] * 3, sample=torch.randn(2, 2))


@pytest.mark.parametrize("how", ["time", "size"])
def test_auto_balance_leaves_the_random_stream_alone(how: str) -> None:
    # Profiling runs dropout: the caller's seeded draws after building the
    # pipe must be those the plain model gets.
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5))
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    expected = model(x)
    torch.manual_seed(0)
    pipe = Pipe(model, chunks=1, balance=how, devices=["cpu", "cpu"], sample=x)
    torch.testing.assert_close(pipe(x), expected)


class Scaled(nn.Module):
    def forward(self, x: Tensor, weight: Tensor) -> Tensor:
        return x * weight


@pytest.mark.parametrize("how", ["time", "size"])
def test_auto_balance_takes_a_no_chunk_sample(how: str) -> None:
    # The sample is the pipe's call; a NoChunk tensor in it is given whole.
    model = nn.Sequential(Scaled(), nn.Linear(8, 8), nn.Linear(8, 8))
    x, weight = torch.randn(4, 8), torch.randn(1, 8)
    pipe = Pipe(model, chunks=2, balance=how, devices=["cpu", "cpu"], sample=(x, NoChunk(weight)))
    expected = model[2](model[1](model[0](x, weight)))
    torch.testing.assert_close(pipe(x, NoChunk(weight)), expected)


class _DictInput(nn.Module):
    """Reads its input from a dict batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        out: Tensor = self.b(torch.relu(self.a(batch["x"])))
        return out


@pytest.mark.cuda
def test_units_are_profiled_on_the_device_with_a_dict_sample_from_the_host() -> None:
    names, profiles = profile_units(_DictInput().cuda(), ({"x": torch.randn(4, 4)},))
    assert names == ["b"] and len(profiles) == 2


@pytest.mark.parametrize("how", [balance_by_time, balance_by_size])
def test_balancing_on_a_device_this_machine_lacks_names_the_argument(how: Any) -> None:
    # torchgpipe's device= copied onto a machine without that GPU: the
    # argument named before the copy of the model moves, not torch's driver error.
    missing = f"cuda:{torch.cuda.device_count()}"
    layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=rf"^device is {missing}, but .* here; available devices"):
        how(layers, torch.randn(2, 2), 2, device=missing)


class Encoder(nn.Module):
    """Blocks in a ModuleList held by a child, as torchvision's ViT holds
    its encoder blocks (encoder.layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.encoder, self.head = nn.Linear(4, 4), Encoder(), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(self.stem(x)))


def test_auto_balance_splits_among_blocks_a_child_holds_in_a_list() -> None:
    from mpstream.stages.fx import call_units

    model = Wrapped().double()
    units = [*(f"encoder.layers.{i}" for i in range(4)), "head"]  # stem begins the forward
    assert call_units(model) == units  # 'encoder' alone left no cut inside it
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe = Pipe(Wrapped().double(), balance="size", sample=x, devices=["cpu"] * 2, chunks=2)
    assert pipe.split_points == ["encoder.layers.2"]
    pipe.load_state_dict(model.state_dict())
    torch.testing.assert_close(pipe(x), model(x))


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("how", ["time", "size"])
def test_auto_balance_refuses_a_hook_on_a_module_its_trace_enters_before_it_runs(
    tracer: str, how: str
) -> None:
    # Its trace ran the hook on a proxy (a stand-in for torch.export)
    # before the pipe's own trace refused it.
    model = Wrapped().double()
    seen: list[Any] = []
    handle = model.encoder.register_forward_hook(lambda m, args, out: seen.append(out))
    x = torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="module 'encoder' has a forward hook"):
        Pipe(model, balance=how, sample=x, devices=["cpu"] * 2, tracer=tracer)
    assert seen == []
    handle.remove()
    pipe = Pipe(model, balance=how, sample=x, devices=["cpu"] * 2, tracer=tracer, chunks=2)
    torch.testing.assert_close(pipe(x), model(x))

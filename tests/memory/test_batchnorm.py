"""Deferred BatchNorm: running statistics equal the single-device model on
the whole batch, once per mini-batch, with any split and checkpoint mode."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.memory.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm, deferred_norms
from tests.models import FailOnce

MODES = ["never", "except_last", "always"]


def conv_net() -> nn.Sequential:
    """Three BatchNorms in series (the later ones see normalised inputs)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8, momentum=None),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
        nn.BatchNorm1d(5),
    )


def one_norm_net(position: int) -> nn.Sequential:
    """One BatchNorm, after ``position`` per-sample layers: its input does not
    depend on how the batch is split, so the whole-batch model is exact."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 6, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(6, 6, 3, padding=1),
        nn.Tanh(),
    ]
    layers.insert(
        position, nn.BatchNorm2d(layers[position - 1].out_channels if position % 2 else 6)
    )
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(6 * 8 * 8, 4))


def running_stats(model: nn.Module) -> list[torch.Tensor]:
    return [
        b
        for name, b in model.named_buffers()
        if name.split(".")[-1].startswith(("running", "num_batches"))
    ]


def assert_same_stats(pipe: nn.Module, expected: list[torch.Tensor]) -> None:
    got = running_stats(pipe)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-4)


def whole_batch_statistics(model: nn.Module, x: torch.Tensor, split: int) -> list[torch.Tensor]:
    """Each BatchNorm's running statistics after one update with the mean and
    unbiased variance of all the inputs it sees over the micro-batches of
    ``x``: deferred BatchNorm's contract when BatchNorms are in series."""
    ref = copy.deepcopy(model).train()
    norms = [m for m in ref.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    seen: dict[nn.Module, list[torch.Tensor]] = {m: [] for m in norms}
    for m in norms:
        m.register_forward_pre_hook(lambda mod, args: seen[mod].append(args[0].detach().double()))
    before = [
        (m.running_mean.clone(), m.running_var.clone(), int(m.num_batches_tracked)) for m in norms
    ]
    with torch.no_grad():
        for part in x.split(split):
            ref(part)
    out = []
    for m, (mean0, var0, tracked) in zip(norms, before):
        inputs = torch.cat(seen[m])
        dims = [0, *range(2, inputs.dim())]
        mean = inputs.mean(dims)
        var = inputs.var(dims, unbiased=True)
        factor = 1.0 / (tracked + 1) if m.momentum is None else m.momentum
        out += [
            (1 - factor) * mean0.double() + factor * mean,
            (1 - factor) * var0.double() + factor * var,
            torch.tensor(tracked + 1),
        ]
    return out


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("position", [1, 3, 4])
@pytest.mark.parametrize(
    ("split_size", "chunks"), [(1, None), (3, None), (5, None), (None, 4), (None, 1)]
)
def test_running_stats_equal_the_single_device_model_on_the_whole_batch(
    checkpoint: str, position: int, split_size: int | None, chunks: int | None
) -> None:
    model = one_norm_net(position)
    ref = copy.deepcopy(model)
    pipe = Pipe(
        model,
        chunks=chunks,
        split_size=split_size,
        balance=[2, 3, 2],
        devices=["cpu"] * 3,
        deferred_batch_norm=True,
        checkpoint=checkpoint,
    )
    for _ in range(3):
        x = torch.randn(11, 3, 8, 8) * 2 + 0.5
        pipe(x).sum().backward()
        ref(x)
        assert_same_stats(pipe, running_stats(ref))


# Every micro-batch keeps at least 2 samples: BatchNorm1d cannot normalise 1.
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("split_size", [2, 5, 7, 12])
def test_norms_in_series_use_whole_batch_statistics_of_their_inputs(
    checkpoint: str, split_size: int
) -> None:
    model = conv_net()
    pipe = Pipe(
        copy.deepcopy(model),
        split_size=split_size,
        balance=[3, 4, 3],
        devices=["cpu"] * 3,
        deferred_batch_norm=True,
        checkpoint=checkpoint,
    )
    for _ in range(2):
        x = torch.randn(12, 3, 8, 8) * 2 + 0.5
        expected = whole_batch_statistics(pipe, x, split_size)
        pipe(x).sum().backward()
        assert_same_stats(pipe, expected)
    pipe.eval()
    model.load_state_dict(pipe.state_dict())
    model.eval()
    x = torch.randn(6, 3, 8, 8)
    torch.testing.assert_close(pipe(x), model(x))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_train_step_updates_statistics_once(schedule: str, checkpoint: str) -> None:
    model = one_norm_net(1)
    ref = copy.deepcopy(model)
    pipe = Pipe(
        model,
        split_size=3,
        balance=[3, 4],
        devices=["cpu", "cpu"],
        deferred_batch_norm=True,
        checkpoint=checkpoint,
        schedule=schedule,
    )
    for _ in range(2):
        x, y = torch.randn(10, 3, 8, 8), torch.randn(10, 4)
        pipe.train_step(x, y, nn.MSELoss())
        ref(x)
        assert_same_stats(pipe, running_stats(ref))


def test_outputs_normalise_each_micro_batch() -> None:
    norm = DeferredBatchNorm(4)
    plain = nn.BatchNorm1d(4)
    x = torch.randn(6, 4)
    norm.expected = 2
    for part in x.split(3):
        torch.testing.assert_close(norm(part), plain(part))
    assert int(norm.num_batches_tracked) == 1
    assert int(plain.num_batches_tracked) == 2


def test_conversion_keeps_parameters_and_keys() -> None:
    model = conv_net()
    keys = list(model.state_dict())
    weights = [model[1].weight, model[1].running_mean]
    converted = convert_deferred_batch_norm(model)
    assert converted is model
    assert list(model.state_dict()) == keys
    assert model[1].weight is weights[0] and model[1].running_mean is weights[1]
    assert len(deferred_norms(model)) == 3
    assert (
        DeferredBatchNorm.convert(nn.BatchNorm1d(3, track_running_stats=False)).__class__
        is nn.BatchNorm1d
    )
    assert isinstance(DeferredBatchNorm.convert(nn.BatchNorm2d(3)), DeferredBatchNorm)


def test_dtype_conversion_keeps_float64_accumulators() -> None:
    norm = DeferredBatchNorm(3).half()
    assert norm.weight.dtype == torch.float16
    assert norm.sum.dtype == torch.float64 and norm.count.dtype == torch.float64


def test_eval_mode_does_not_accumulate() -> None:
    norm = DeferredBatchNorm(3).eval()
    norm(torch.randn(4, 3))
    assert norm.tracked == 0 and float(norm.count) == 0


def test_rejects_1d_input() -> None:
    with pytest.raises(ValueError, match="at least 2D"):
        DeferredBatchNorm(3)(torch.randn(3))


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("train", [True, False])
def test_rejects_input_with_other_channels_and_keeps_its_sums(affine: bool, train: bool) -> None:
    # Without a weight, the training forward had nothing checking the
    # channels: one channel broadcast into all four channels' sums.
    norm = DeferredBatchNorm(4, affine=affine).train(train)
    for channels in (1, 3):
        with pytest.raises(ValueError, match=r"4 channels \(dim 1, num_features\).*\(6, "):
            norm(torch.randn(6, channels, 5))
    assert norm.tracked == 0 and float(norm.count) == 0 and float(norm.sum.abs().sum()) == 0


def test_cumulative_average_stays_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """momentum=None needs 1 / num_batches_tracked; computing it as a Python
    float would synchronize the host with the device once per layer."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None)).double()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=2, deferred_batch_norm=True, balance=[1, 1], devices=["cpu"] * 2)

    def no_host_read(self: torch.Tensor) -> float:
        raise AssertionError("float() of a tensor")

    for _ in range(3):
        x = torch.randn(8, 4, dtype=torch.float64)
        ref(x)
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "__float__", no_host_read)
            pipe(x)
    norm = pipe[1]
    torch.testing.assert_close(norm.running_mean, ref[1].running_mean)
    torch.testing.assert_close(norm.running_var, ref[1].running_var)


def test_cumulative_average_of_a_float64_norm_is_exact() -> None:
    """momentum=None's factor 1 / num_batches_tracked: an integer tensor's
    reciprocal is float32, which put a float64 layer's statistics off by
    about 1e-8 relative from the plain layer's."""
    torch.manual_seed(0)
    ref = nn.BatchNorm1d(3, momentum=None).double()
    norm = DeferredBatchNorm.convert(copy.deepcopy(ref))
    for _ in range(3):
        x = torch.randn(8, 3, dtype=torch.float64) * 5 + 10
        ref(x)
        norm(x)
    torch.testing.assert_close(norm.running_mean, ref.running_mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(norm.running_var, ref.running_var, rtol=1e-12, atol=0)


@pytest.mark.parametrize("fail_at", [2, 3])  # the norm's stage, then the next stage
def test_failed_forward_leaves_no_partial_statistics(fail_at: int) -> None:
    def build(failing: bool) -> Pipe:
        torch.manual_seed(0)
        layers = [nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)]
        layers.insert(1 if fail_at == 2 else 3, FailOnce(fail_at if failing else 0))
        return Pipe(
            nn.Sequential(*layers).double(),
            chunks=4,
            balance=[3, 1],
            devices=["cpu", "cpu"],
            deferred_batch_norm=True,
        )

    pipe, ref = build(True), build(False)
    with pytest.raises(RuntimeError, match="stage failed"):
        pipe(torch.randn(8, 3, dtype=torch.float64))
    norm = deferred_norms(pipe)[0]
    assert norm.tracked == 0 and float(norm.count) == 0
    for _ in range(2):
        x = torch.randn(8, 3, dtype=torch.float64)
        pipe(x)
        ref(x)
        assert_same_stats(pipe, running_stats(ref))


def test_norms_converted_after_the_pipe_was_built_are_deferred() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)), nn.Linear(3, 2))
    pipe = Pipe(model, chunks=4, balance=[1, 1], devices=["cpu", "cpu"])
    pipe(torch.randn(16, 2))  # the pipe has looked for deferred norms once
    convert_deferred_batch_norm(pipe)
    (norm,) = deferred_norms(pipe)
    before = int(norm.num_batches_tracked)  # 4: the plain norm's, one per micro-batch
    pipe(torch.randn(16, 2))
    assert int(norm.num_batches_tracked) == before + 1  # one update for the mini-batch


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("step", [False, True])
def test_a_lazy_norm_is_deferred_once_it_knows_its_channels(checkpoint: str, step: bool) -> None:
    # Its parameters and buffers are sized by the first forward: the
    # accumulators were not, and that forward failed on the weight.
    def build() -> nn.Sequential:  # a lazy module cannot be deep-copied
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.LazyBatchNorm2d(momentum=None),
                             nn.Tanh(), nn.Flatten(), nn.Linear(6 * 4 * 4, 2)).double()  # fmt: skip

    ref = build()
    pipe = Pipe(
        build(),
        chunks=3,
        balance=[2, 3],
        devices=["cpu", "cpu"],
        deferred_batch_norm=True,
        checkpoint=checkpoint,
    )
    for _ in range(2):
        x = torch.randn(9, 3, 4, 4, dtype=torch.float64)
        y = torch.randn(9, 2, dtype=torch.float64)
        if step:
            pipe.train_step(x, y, nn.MSELoss())
        else:
            pipe(x).sum().backward()
        ref(x)
        assert type(pipe[1]) is DeferredBatchNorm and pipe[1].sum.shape == (6,)
        assert_same_stats(pipe, running_stats(ref))
    assert list(pipe.state_dict()) == list(ref.state_dict())


def test_a_pipe_that_fails_to_build_leaves_the_batch_norms_as_they_were() -> None:
    from mpstream import Pipe

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    norm = model[1]
    with pytest.raises(ValueError, match="balance"):
        Pipe(model, balance=[1, 1], deferred_batch_norm=True)  # 3 layers
    assert model[1] is norm
    with pytest.raises(ValueError, match="virtual_stages"):  # after the split: the schedule
        Pipe(model, balance=[1, 1, 1], deferred_batch_norm=True, schedule="interleaved_1f1b")
    assert model[1] is norm
    pipe = Pipe(model, balance=[2, 1], chunks=2, deferred_batch_norm=True)
    assert type(pipe[1]).__name__ == "DeferredBatchNorm"


@pytest.mark.parametrize("checkpoint", MODES)
def test_a_norm_called_twice_updates_as_the_single_device_model(checkpoint: str) -> None:
    # The same BatchNorm at two places of the Sequential: each call updates
    # the shared statistics once per mini-batch, with the whole batch of its
    # own input, in call order.
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4, momentum=None)
    model = nn.Sequential(nn.Linear(4, 4), norm, nn.Tanh(), nn.Linear(4, 4), norm, nn.Tanh())
    ref = copy.deepcopy(model)
    pipe = Pipe(
        model,
        chunks=3,
        balance=[3, 3],
        devices=["cpu", "cpu"],
        deferred_batch_norm=True,
        checkpoint=checkpoint,
    )
    assert all(type(m) is DeferredBatchNorm for m in (pipe[1], pipe[4]))
    inputs: list[torch.Tensor] = []
    ref[1].register_forward_pre_hook(lambda _, a: inputs.append(a[0].detach()))
    mean, var, calls = ref[1].running_mean.clone(), ref[1].running_var.clone(), 0
    for _ in range(2):
        x = torch.randn(12, 4)
        pipe(x).sum().backward()
        inputs.clear()
        with torch.no_grad():
            for micro in x.chunk(3):
                ref(micro)  # normalises each micro-batch as the pipe does
        for first in (True, False):  # the calls of each micro-batch alternate
            whole = torch.cat(inputs[0 if first else 1 :: 2])
            calls += 1
            mean += (whole.mean(0) - mean) / calls
            var += (whole.var(0) - var) / calls
        torch.testing.assert_close(pipe[1].running_mean, mean)
        torch.testing.assert_close(pipe[1].running_var, var)
        assert int(pipe[1].num_batches_tracked) == calls


def test_a_sync_batch_norm_is_refused_and_nothing_is_converted() -> None:
    # Deferring it would drop its synchronisation across processes silently.
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.SyncBatchNorm(4))
    with pytest.raises(
        TypeError, match=r"nn.SyncBatchNorm layer\(s\) '2'.*leave deferred_batch_norm"
    ):
        Pipe(model, chunks=2, balance=[2, 1], devices=["cpu", "cpu"], deferred_batch_norm=True)
    assert [type(m) for m in model] == [nn.Linear, nn.BatchNorm1d, nn.SyncBatchNorm]
    with pytest.raises(TypeError, match="'SyncBatchNorm'"):
        DeferredBatchNorm.convert(nn.SyncBatchNorm(4))

"""Activation checkpointing: same gradients, recomputation where expected,
RNG restored for dropout, BatchNorm statistics updated once."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.utils import checkpoint as torch_checkpoint

import mpstream
from mpstream import Pipe
from mpstream.memory.checkpoint import MODES, check_mode, checkpoint_stop, is_recomputing
from tests.helpers import assert_same_grads, mlp

BATCH = 10


def test_invalid_mode_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="'always', 'except_last', 'never'"):
        check_mode("sometimes")
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        Pipe(nn.Sequential(nn.Linear(2, 2)), checkpoint=True)  # type: ignore[arg-type]


def test_checkpoint_stop_policy() -> None:
    assert checkpoint_stop("always", 4, True) == 4
    assert checkpoint_stop("except_last", 4, True) == 3
    assert checkpoint_stop("never", 4, True) == 0
    assert checkpoint_stop("always", 4, False) == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split_size", [1, 3, 7])
def test_gradients_equal_the_single_device_model(mode: str, split_size: int) -> None:
    model = mlp([5, 8, 7, 4])
    ref = copy.deepcopy(model)
    pipe = Pipe(
        model, split_size=split_size, balance=[2, 2, 2], devices=["cpu"] * 3, checkpoint=mode
    )
    x = torch.randn(BATCH, 5, dtype=torch.float64, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    out = pipe(x)
    expected = ref(xr)
    torch.testing.assert_close(out, expected)
    out.pow(3).sum().backward()
    expected.pow(3).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    assert_same_grads(pipe, ref)


class Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).double()
        self.calls = 0
        self.recomputes = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        self.recomputes += is_recomputing()
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize(
    ("mode", "train", "expected"),
    [
        ("always", True, 8),
        ("except_last", True, 7),
        ("never", True, 4),
        ("always", False, 4),
    ],
)
def test_recomputation_happens_where_expected(mode: str, train: bool, expected: int) -> None:
    stages = [Counted(), Counted()]
    pipe = Pipe(nn.Sequential(*stages), chunks=4, checkpoint=mode).train(train)
    pipe(torch.randn(8, 3, dtype=torch.float64)).sum().backward()
    for st in stages:
        assert st.calls == expected
        assert st.recomputes == expected - 4


class _Doubled(nn.Module):
    """Saves nothing for backward (a product by a number)."""

    def __init__(self) -> None:
        super().__init__()
        self.recomputes = 0

    def forward(self, x: Tensor) -> Tensor:
        self.recomputes += is_recomputing()
        return x * 2.0


def test_recomputation_stops_once_backward_has_what_it_needs() -> None:
    # As the guide says (torchgpipe reran the whole partition): a layer
    # whose output a later layer saves runs again, a trailing one does not.
    inner, trailing = _Doubled(), _Doubled()
    model = nn.Sequential(nn.Linear(3, 3), inner, nn.Linear(3, 3), trailing)
    pipe = Pipe(model, chunks=2, balance=[4], devices=["cpu"], checkpoint="always")
    pipe(torch.randn(4, 3)).sum().backward()
    assert (inner.recomputes, trailing.recomputes) == (2, 0)


@pytest.mark.parametrize("mode", ["always", "except_last"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dropout_masks_match_after_recomputation(mode: str, schedule: str) -> None:
    def build(checkpoint: str) -> Pipe:
        torch.manual_seed(1)
        model = nn.Sequential(
            nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.3), nn.Linear(16, 2)
        ).double()
        return Pipe(
            model,
            split_size=3,
            balance=[2, 3],
            devices=["cpu", "cpu"],
            checkpoint=checkpoint,
            schedule=schedule,
        )

    plain, ckpt = build("never"), build(mode)
    x, y = torch.randn(BATCH, 6, dtype=torch.float64), torch.randn(BATCH, 2, dtype=torch.float64)
    torch.manual_seed(7)
    loss_plain = plain.train_step(x, y, nn.MSELoss())
    torch.manual_seed(7)
    loss_ckpt = ckpt.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(loss_ckpt, loss_plain)
    assert_same_grads(ckpt, plain)


class _InitialisesCuda(nn.Module):
    """Marks CUDA initialised in its forward, as torch.compile's first call
    does on a GPU machine, and draws random numbers."""

    def forward(self, x: Tensor) -> Tensor:
        torch.cuda._initialized = True  # type: ignore[attr-defined]
        return nn.functional.dropout(x, 0.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes CUDA's lazy initialisation")
def test_cpu_stages_may_initialise_cuda_in_a_checkpointed_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found on the H100: torch's checkpoint keeps the default device type's
    # RNG too (CUDA's) and refused a CPU stage's forward that initialised it.
    # torch 2.11 watches CUDA by default; later versions the current
    # accelerator, which a CPU-only build has none of.
    monkeypatch.setattr(torch_checkpoint.DefaultDeviceType, "_default_device_type", "cuda")
    monkeypatch.setattr(torch.cuda, "_initialized", False)

    def build(checkpoint: str) -> Pipe:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(6, 16), _InitialisesCuda(), nn.Linear(16, 2)).double()
        devices = ["cpu", "cpu"]
        return Pipe(model, split_size=3, balance=[2, 1], devices=devices, checkpoint=checkpoint)

    plain, ckpt = build("never"), build("always")
    x, y = torch.randn(BATCH, 6, dtype=torch.float64), torch.randn(BATCH, 2, dtype=torch.float64)
    torch.manual_seed(7)
    loss_plain = plain.train_step(x, y, nn.MSELoss())
    monkeypatch.setattr(torch.cuda, "_initialized", False)
    torch.manual_seed(7)
    loss_ckpt = ckpt.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(loss_ckpt, loss_plain)
    assert_same_grads(ckpt, plain)


@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_plain_batchnorm_statistics_are_updated_once(mode: str) -> None:
    def build(checkpoint: str) -> Pipe:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2)
        ).double()
        return Pipe(
            model, split_size=4, balance=[3, 1], devices=["cpu", "cpu"], checkpoint=checkpoint
        )

    plain, ckpt = build("never"), build(mode)
    x = torch.randn(12, 4, dtype=torch.float64)
    plain(x).sum().backward()
    ckpt(x).sum().backward()
    for (name, a), b in zip(ckpt.named_buffers(), plain.buffers()):
        torch.testing.assert_close(a, b, msg=name)
    assert_same_grads(ckpt, plain)


def test_tuple_values_through_checkpointed_stages() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3).double()

        def forward(self, xy: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
            x, y = xy
            return self.lin(x) * y, y + 1

    model = nn.Sequential(Pair(), Pair())
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=3, checkpoint="always")
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    out = pipe((x, y))
    expected = ref((x, y))
    torch.testing.assert_close(out, expected)
    out[0].sum().backward()
    expected[0].sum().backward()
    assert_same_grads(pipe, ref)


def test_batchnorm_buffers_saved_by_other_graphs_stay_valid() -> None:
    """1F1B with 'except_last' keeps the last micro-batch's graph (which saved
    BatchNorm's running statistics) alive across another micro-batch's
    recomputation; restoring the statistics must not invalidate it."""
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2)).double()
    ref = copy.deepcopy(model)
    pipe = Pipe(
        model,
        split_size=4,
        balance=[2, 2],
        devices=["cpu", "cpu"],
        schedule="1f1b",
        checkpoint="except_last",
    )
    x, y = torch.randn(12, 4, dtype=torch.float64), torch.randn(12, 2, dtype=torch.float64)
    loss = pipe.train_step(x, y, nn.MSELoss())
    expected = sum(
        nn.MSELoss()(ref(xp), yp) * len(xp) / 12 for xp, yp in zip(x.split(4), y.split(4))
    )
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)
    for a, b in zip(pipe.buffers(), ref.buffers()):
        torch.testing.assert_close(a, b)


class SideEffects(nn.Module):
    """Counts a side effect that must happen once per micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).double()
        self.effects = self.checkpointing = self.recomputing = 0

    def forward(self, x: Tensor) -> Tensor:
        assert not (mpstream.is_checkpointing() and mpstream.is_recomputing())
        if not mpstream.is_recomputing():
            self.effects += 1
        self.checkpointing += mpstream.is_checkpointing()
        self.recomputing += mpstream.is_recomputing()
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize(
    ("mode", "checkpointed"), [("never", 0), ("except_last", 3), ("always", 4)]
)
@pytest.mark.parametrize("path", ["forward", "gpipe", "1f1b"])
def test_side_effects_run_once_per_micro_batch(mode: str, checkpointed: int, path: str) -> None:
    stages = [SideEffects(), SideEffects()]
    schedule = "gpipe" if path == "forward" else path
    pipe = Pipe(nn.Sequential(*stages), chunks=4, checkpoint=mode, schedule=schedule)
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    if path == "forward":
        pipe(x).sum().backward()
    else:
        pipe.train_step(x, y, nn.MSELoss())
    for st in stages:
        assert (st.effects, st.checkpointing, st.recomputing) == (4, checkpointed, checkpointed)
    assert not mpstream.is_checkpointing() and not mpstream.is_recomputing()


class Doubled(nn.Module):
    """An in-place op that is not idempotent: recomputing from an input it
    already overwrote would give other values."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(2)


@pytest.mark.parametrize("mode", ["except_last", "always"])
@pytest.mark.parametrize("path", ["forward", "gpipe", "1f1b"])
@pytest.mark.parametrize("first", [nn.ReLU(inplace=True), Doubled()], ids=["relu_", "mul_"])
def test_stage_may_begin_with_an_in_place_op(mode: str, path: str, first: nn.Module) -> None:
    model = nn.Sequential(nn.Linear(5, 6), first, nn.Tanh(), nn.Linear(6, 3)).double()
    ref = copy.deepcopy(model)
    pipe = Pipe(
        model,
        split_size=3,
        balance=[1, 3],
        devices=["cpu", "cpu"],
        checkpoint=mode,
        schedule="gpipe" if path == "forward" else path,
    )
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 3, dtype=torch.float64)
    if path == "forward":
        out = pipe(x)
        torch.testing.assert_close(out, ref(x))
        nn.MSELoss()(out, y).backward()
    else:
        pipe.train_step(x, y, nn.MSELoss())
    nn.MSELoss()(ref(x), y).backward()
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_a_second_backward_recomputes_again(mode: str) -> None:
    # retain_graph=True, and a gradient penalty (a double backward): each
    # backward through a checkpointed stage recomputes it once more.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2), nn.Tanh()
    ).double()
    pipe = Pipe(copy.deepcopy(model), split_size=3, balance=[3, 2], devices=["cpu"] * 2,
                checkpoint=mode)  # fmt: skip
    ref = copy.deepcopy(model)
    x = torch.randn(6, 4, dtype=torch.float64)
    out, expected = pipe(x), torch.cat([ref(m) for m in x.split(3)])
    torch.testing.assert_close(out, expected)
    for _ in range(2):
        out.sum().backward(retain_graph=True)
        expected.sum().backward(retain_graph=True)
    assert_same_grads(pipe, ref)
    for (name, a), b in zip(pipe.named_buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, msg=name)  # statistics updated once
    pipe.zero_grad()
    ref.zero_grad()
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    (gs,) = torch.autograd.grad(pipe(xs).pow(2).sum(), xs, create_graph=True)
    (gr,) = torch.autograd.grad(
        torch.cat([ref(m) for m in xr.split(3)]).pow(2).sum(), xr, create_graph=True
    )
    torch.testing.assert_close(gs, gr)
    gs.pow(2).sum().backward()
    gr.pow(2).sum().backward()
    assert_same_grads(pipe, ref)


@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_instance_norm_statistics_are_updated_once_and_restored(mode: str) -> None:
    def build(checkpoint: str) -> Pipe:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv1d(2, 3, 3, padding=1), nn.InstanceNorm1d(3, track_running_stats=True),
            nn.Tanh(), nn.Flatten(), nn.Linear(15, 2),
        ).double()  # fmt: skip
        return Pipe(model, chunks=4, balance=[3, 2], devices=["cpu"] * 2, checkpoint=checkpoint)

    plain, ckpt = build("never"), build(mode)
    x, y = torch.randn(8, 2, 5, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    plain.train_step(x, y, nn.MSELoss())
    ckpt.train_step(x, y, nn.MSELoss())
    for (name, a), b in zip(ckpt.named_buffers(), plain.buffers()):
        torch.testing.assert_close(a, b, msg=name)
    before = [b.clone() for b in ckpt.buffers()]
    calls = [0]

    def failing(out: Tensor, target: Tensor) -> Tensor:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("boom")
        return nn.functional.mse_loss(out, target)

    with pytest.raises(RuntimeError, match="boom"):
        ckpt.train_step(x, y, failing)
    for a, b in zip(ckpt.buffers(), before):
        torch.testing.assert_close(a, b)  # a failed step leaves no statistics behind


@pytest.mark.parametrize("stats", [True, False])
def test_lazy_norms_train(stats: bool) -> None:
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.LazyInstanceNorm1d(track_running_stats=stats),
                          nn.Flatten(), nn.Linear(9, 2))  # fmt: skip
    pipe = Pipe(model, chunks=2, balance=[2, 2], devices=["cpu"] * 2, checkpoint="always")
    loss = pipe.train_step(torch.randn(4, 2, 5), torch.randn(4, 2), nn.MSELoss())
    assert loss.isfinite()


class _Fails(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        raise ValueError("the stage failed")


def test_a_failed_checkpointed_forward_leaves_no_checkpoint_context_entered() -> None:
    """torch 2.11's checkpoint left its saved-tensor hooks and the forward
    context entered while the failure's traceback lived: a later plain
    backward reran the failed forward, and is_checkpointing() stayed true."""
    from mpstream.memory.checkpoint import checkpointed

    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match="the stage failed") as info:
        checkpointed(_Fails(), x)
    assert info.value.__traceback__ is not None  # held, as a caller's handler may
    assert not mpstream.is_checkpointing() and not is_recomputing()
    w = torch.randn(3, requires_grad=True)
    (w * w).sum().backward()  # type: ignore[no-untyped-call]
    assert w.grad is not None

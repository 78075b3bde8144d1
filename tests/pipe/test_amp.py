"""Mixed precision: torch.autocast around pipe(x) and train_step (each stage
and each recomputation runs under the caller's autocast state), and a
torch.amp.GradScaler stepping after train_step. On the CPU autocast runs in
bfloat16; the pipe must equal the unsplit model run on the same micro-batches
under the same autocast, exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe

BATCH, SPLIT = 10, 3
MODES = ["never", "except_last", "always"]
BF16 = {"device_type": "cpu", "dtype": torch.bfloat16}


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)
    )


def assert_equal_grads(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("checkpoint", MODES)
def test_autocast_forward_and_backward_equal_the_unsplit_model(checkpoint: str) -> None:
    ref = model()
    pipe = Pipe(
        copy.deepcopy(ref),
        split_size=SPLIT,
        balance=[2, 3],
        devices=["cpu"] * 2,
        checkpoint=checkpoint,
    )
    x = torch.randn(BATCH, 8)
    with torch.autocast(**BF16):
        out = pipe(x)
        expected = torch.cat([ref(part) for part in x.split(SPLIT)])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # Backward outside the autocast block, as recommended: recomputation
    # still runs under the forward's state.
    out.float().pow(2).sum().backward()
    expected.float().pow(2).sum().backward()
    assert_equal_grads(pipe, ref)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_autocast_train_step_equals_the_unsplit_model(schedule: str, checkpoint: str) -> None:
    ref = model()
    pipe = Pipe(
        copy.deepcopy(ref),
        split_size=SPLIT,
        balance=[2, 3],
        devices=["cpu"] * 2,
        checkpoint=checkpoint,
        schedule=schedule,
    )
    x, y = torch.randn(BATCH, 8), torch.randn(BATCH, 4)
    with torch.autocast(**BF16):
        loss = pipe.train_step(x, y, nn.MSELoss())
        expected = torch.zeros(())
        for xp, yp in zip(x.split(SPLIT), y.split(SPLIT)):
            part = nn.MSELoss()(ref(xp), yp) * (len(xp) / BATCH)
            part.backward()
            expected += part.detach()
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    assert_equal_grads(pipe, ref)


class Seen(nn.Module):
    """Records the autocast state of every call, recomputations included."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.states: list[tuple[bool, torch.dtype]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.states.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return self.lin(x)


@pytest.mark.parametrize("path", ["forward", "train_step"])
def test_recomputation_runs_under_the_callers_autocast(path: str) -> None:
    stages = [Seen(), Seen()]
    pipe = Pipe(nn.Sequential(*stages), chunks=2, checkpoint="always")
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    with torch.autocast(**BF16):
        if path == "forward":
            out = pipe(x)
        else:
            pipe.train_step(x, y, nn.MSELoss())
    if path == "forward":
        out.float().sum().backward()  # recomputes outside the block
    for st in stages:
        assert st.states == [(True, torch.bfloat16)] * 4  # 2 forwards, 2 recomputations


def scaled_steps(schedule: str, dtype: torch.dtype, init_scale: float, overflow: bool) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)
    pipe = Pipe(
        copy.deepcopy(ref),
        split_size=SPLIT,
        balance=[2, 1],
        devices=["cpu"] * 2,
        schedule=schedule,
    )
    scalers = [torch.amp.GradScaler("cpu", init_scale=init_scale) for _ in range(2)]
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pipe, ref)]
    for _ in range(2):
        before = [p.detach().clone() for p in pipe.parameters()]
        x, y = torch.randn(BATCH, 8, dtype=dtype), torch.randn(BATCH, 4, dtype=dtype)
        if overflow:
            y *= 1e6
        loss = pipe.train_step(x, y, nn.MSELoss(), scaler=scalers[0])
        expected = nn.MSELoss()(ref(x), y)
        scalers[1].scale(expected).backward()
        torch.testing.assert_close(loss, expected.detach())  # unscaled
        if overflow:
            for m in (pipe, ref):
                assert not all(bool(p.grad.isfinite().all()) for p in m.parameters())
        else:
            for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
                torch.testing.assert_close(a.grad, b.grad, msg=name)  # both scaled
        for scaler, opt in zip(scalers, optims):
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        for a, b, old in zip(pipe.parameters(), ref.parameters(), before):
            torch.testing.assert_close(a, b)
            if overflow:
                torch.testing.assert_close(a, old)  # the overflowing step is skipped


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_grad_scaler_step_equals_the_unsplit_model(schedule: str) -> None:
    scaled_steps(schedule, torch.float64, 2.0**10, overflow=False)


def test_grad_scaler_skips_an_overflowing_step_as_the_unsplit_model() -> None:
    # 2**127 times a large float32 gradient overflows; update() halves the scale.
    scaled_steps("1f1b", torch.float32, 2.0**127, overflow=True)


def test_scaler_must_be_a_grad_scaler() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler, got float"):
        pipe.train_step(torch.randn(2, 2), torch.randn(2, 2), nn.MSELoss(), scaler=2.0)  # type: ignore[arg-type]

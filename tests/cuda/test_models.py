"""Models as users train them on GPUs: tied weights, autocast and GradScaler,
compiled stages, an in-place first op under checkpointing, deferred
statistics after a failed forward, a device that does not exist.

Marked ``cuda``: skipped cleanly without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpstream import Pipe
from tests.cuda.helpers import (
    BATCH,
    run_and_compare,
    two_gpus,
)
from tests.helpers import mlp
from tests.models import FailOnce

pytestmark = pytest.mark.cuda


def test_tied_weights_on_one_gpu_match_cpu() -> None:
    model = mlp([5, 5, 5, 5])
    model[4].weight = model[0].weight  # stages 0 and 2 share it, both on cuda:0
    ref = copy.deepcopy(model)
    pipe = Pipe(copy.deepcopy(model).cuda(), split_size=3, balance=[2, 2, 2],
                devices=["cuda:0"] * 3, schedule="1f1b", checkpoint="except_last")  # fmt: skip
    run_and_compare(ref, pipe, torch.randn(BATCH, 5, dtype=torch.float64, device="cuda:0"))
    pipe.zero_grad()
    ref.zero_grad()
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 5, dtype=torch.float64)
    pipe.train_step(x, y, nn.MSELoss())
    nn.MSELoss()(ref(x), y).backward()
    for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, msg=name)


@two_gpus
def test_tied_weights_across_gpus_are_rejected() -> None:
    model = mlp([5, 5, 5])
    model[2].weight = model[0].weight
    with pytest.raises(ValueError, match=r"'0\.weight' \(stage 0, cuda:0\) is shared with "
                                         r"'2\.weight' \(stage 1, cuda:1\)"):  # fmt: skip
        Pipe(model, balance=[2, 2], devices=["cuda:0", "cuda:1"])


def test_a_gpu_that_does_not_exist_fails_at_construction() -> None:
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=rf"stage 1 is on {missing}, but only "
                                         r".*available devices: cpu, cuda:0"):  # fmt: skip
        Pipe(mlp([4, 4, 4]), balance=[2, 2], devices=["cuda:0", missing])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_autocast_on_gpus_equals_the_unsplit_model(dtype: torch.dtype, checkpoint: str) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(),
                        nn.Linear(32, 8)).cuda()  # fmt: skip
    pipe = Pipe(copy.deepcopy(ref), split_size=4, balance=[2, 3], devices=["cuda:0"] * 2,
                checkpoint=checkpoint, force_copies=True)  # fmt: skip
    x = torch.randn(BATCH, 16, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        out = pipe(x)
        expected = torch.cat([ref(part) for part in x.split(4)])
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected)
    out.float().pow(2).sum().backward()
    expected.float().pow(2).sum().backward()
    for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_grad_scaler_with_fp16_autocast_train_step(schedule: str) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).cuda()
    pipe = Pipe(copy.deepcopy(ref), split_size=4, balance=[2, 1], devices=["cuda:0"] * 2,
                schedule=schedule, checkpoint="except_last")  # fmt: skip
    scalers = [torch.amp.GradScaler("cuda") for _ in range(2)]
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pipe, ref)]
    for _ in range(3):
        x, y = torch.randn(BATCH, 16, device="cuda"), torch.randn(BATCH, 8, device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = pipe.train_step(x, y, nn.MSELoss(), scaler=scalers[0])
            expected = torch.zeros((), device="cuda")
            for xp, yp in zip(x.split(4), y.split(4)):
                part = nn.MSELoss()(ref(xp), yp) * (len(xp) / BATCH)
                scalers[1].scale(part).backward()
                expected += part.detach()
        torch.testing.assert_close(loss, expected)
        for scaler, opt in zip(scalers, optims):
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, msg=name)


def test_compiled_stages_on_a_gpu_equal_the_eager_pipe() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(inplace=True),
                          nn.Linear(32, 8)).cuda()  # fmt: skip
    kwargs = {"split_size": 4, "balance": [2, 2], "devices": ["cuda:0"] * 2,
              "checkpoint": "except_last", "schedule": "1f1b"}  # fmt: skip
    eager = Pipe(copy.deepcopy(model), **kwargs)  # type: ignore[arg-type]
    compiled = Pipe(model, compile={"backend": "aot_eager"}, **kwargs)  # type: ignore[arg-type]
    x, y = torch.randn(BATCH, 16, device="cuda"), torch.randn(BATCH, 8, device="cuda")
    for pipe in (eager, compiled):
        pipe(x).pow(2).sum().backward()
        pipe.train_step(x, y, nn.MSELoss())
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.mark.parametrize("how", ["forward+backward", "train_step"])
def test_in_place_first_op_with_checkpointing_on_a_gpu(how: str) -> None:
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(inplace=True), nn.Linear(8, 4)).double()
    ref = copy.deepcopy(model)
    pipe = Pipe(copy.deepcopy(model).cuda(), split_size=3, balance=[1, 2],
                devices=["cuda:0"] * 2, checkpoint="always")  # fmt: skip
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, 4, dtype=torch.float64)
    if how == "train_step":
        pipe.train_step(x, y, nn.MSELoss())
    else:
        nn.MSELoss()(pipe(x.cuda()), y.cuda()).backward()
    nn.MSELoss()(ref(x), y).backward()
    for (name, a), b in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, msg=name)


# -- schedules: interleaved 1F1B, zero-bubble H1, user-given orders -------------


# zb_h1's order for 4 stages and 4 micro-batches, every weight pass moved last.


def test_deferred_statistics_survive_a_failed_forward_on_a_gpu() -> None:
    """Stage 1 fails at micro-batch 2, after stage 0's norm may have seen
    every micro-batch: nothing of the failed batch reaches the statistics."""

    def build(failing: bool) -> Pipe:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4),
                              FailOnce(3, RuntimeError("third micro-batch failed")) if failing
                              else nn.Identity()).cuda()  # fmt: skip
        return Pipe(model, chunks=4, balance=[2, 2], devices=["cuda:0"] * 2,
                    deferred_batch_norm=True)  # fmt: skip

    pipe, ref = build(True), build(False)
    with pytest.raises(RuntimeError, match="third micro-batch failed"):
        pipe(torch.randn(16, 8, device="cuda"))
    for _ in range(2):
        x = torch.randn(16, 8, device="cuda")
        pipe(x)
        ref(x)
    for (name, a), b in zip(pipe.named_buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, msg=name)

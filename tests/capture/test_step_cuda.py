"""CapturedStep on one GPU: replays equal plain training (BatchNorm statistics
too), the capture takes no snapshot, and what a CUDA graph cannot hold (a
profile, stages on the CPU and the GPU, a host sync in the optimizer) is
refused with the model and optimizer restored."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpstream import CapturedStep, Pipe
from mpstream.pipe import snapshot
from mpstream.pipe import step as step_py
from tests.capture.steps import BATCH, OPTIMIZERS, HostSyncSGD, check_steps, data, setup
from tests.helpers import mlp


@pytest.mark.cuda
def test_the_captured_step_takes_no_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[bool] = []

    class Counted(snapshot.Snapshot):
        def __init__(self, *args: object) -> None:
            made.append(torch.cuda.is_current_stream_capturing())
            super().__init__(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(step_py, "Snapshot", Counted)
    pipe, opt, _, _ = setup("cuda:0", "sgd", split_size=3)
    step = CapturedStep(pipe, *data("cuda:0", 0), nn.MSELoss(), optimizer=opt, warmup=2)
    assert made == [False, False]  # the warm-up steps only: a replay clones nothing
    step(*data("cuda:0", 1))
    assert len(made) == 2


@pytest.mark.cuda
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_replays_on_one_gpu_equal_plain_training(
    optimizer: str, schedule: str, checkpoint: str
) -> None:
    step = check_steps("cuda:0", optimizer, split_size=3, schedule=schedule, checkpoint=checkpoint)
    assert step.captured
    assert step.reserved_bytes > 0 and step.static_bytes == BATCH * (5 + 4) * 8


@pytest.mark.cuda
def test_replays_keep_batch_norm_statistics_like_eager_steps() -> None:
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return (
            nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
            .double()
            .cuda()
        )

    eager = Pipe(
        model(), split_size=5, balance=[2, 2], devices=["cuda:0"] * 2, deferred_batch_norm=True
    )
    graphed = Pipe(
        model(), split_size=5, balance=[2, 2], devices=["cuda:0"] * 2, deferred_batch_norm=True
    )
    step = CapturedStep(graphed, *data("cuda:0", 0), nn.MSELoss())
    for i in range(3):
        x, y = data("cuda:0", i + 1)
        eager.zero_grad()
        torch.testing.assert_close(step(x, y), eager.train_step(x, y, nn.MSELoss()))
    for (name, a), b in zip(graphed.named_buffers(), eager.buffers()):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.cuda
def test_a_replay_under_a_profile_is_refused() -> None:
    pipe, _, _, _ = setup("cuda:0", "sgd", split_size=3)
    x, y = data("cuda:0", 0)
    step = CapturedStep(pipe, x, y, nn.MSELoss())
    pipe.scheduler.timing = True
    with pytest.raises(ValueError, match="records nothing"):
        step(x, y)
    pipe.scheduler.timing = False
    step(x, y)


@pytest.mark.cuda
def test_stages_on_cpu_and_gpu_or_a_traced_pipe_are_refused() -> None:
    x, y = data("cpu", 0)
    mixed = Pipe(mlp([5, 8, 4]), split_size=3, balance=[2, 2], devices=["cpu", "cuda:0"])
    with pytest.raises(ValueError, match="every stage on CPUs: stages are on cpu, cuda:0"):
        CapturedStep(mixed, x, y, nn.MSELoss())
    pipe, _, _, _ = setup("cuda:0", "sgd", split_size=3)
    pipe.scheduler.timing = True
    with pytest.raises(ValueError, match="being traced"):
        CapturedStep(pipe, x, y, nn.MSELoss())


@pytest.mark.cuda
def test_a_failed_capture_restores_the_model_and_the_optimizer() -> None:
    pipe, _, _, _ = setup("cuda:0", "sgd", split_size=3)
    opt = HostSyncSGD(pipe.parameters(), lr=0.01, momentum=0.9)  # a host sync in the capture
    before = [p.detach().clone() for p in pipe.parameters()]
    x, y = data("cuda:0", 0)
    with pytest.raises(Exception) as info:
        CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt)
    assert any("capturing the step failed" in n for n in getattr(info.value, "__notes__", []))
    for p, b in zip(pipe.parameters(), before):
        torch.testing.assert_close(p.detach(), b)
    pipe.zero_grad()
    pipe.train_step(x, y, nn.MSELoss())  # the pipe still works eagerly

"""CapturedStep(groups=...): a step captured as one graph per segment, each
group's segments on a launch stream of its own, equals plain training on the
CPU (where it runs eagerly) and on one GPU; what cannot be captured in groups
(random numbers drawn in two groups, a tensor two groups share, a torch
without external events) is refused up front; a failed capture leaves torch
and the pipe working."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpstream import CapturedStep, Pipe
from mpstream.capture.edges import check_external_events
from mpstream.schedules.segments import segment
from tests.capture.test_step import assert_trains_like
from tests.helpers import assert_same_grads, mlp


def _steps(device: str, schedule: str, groups: list[int], steps: int = 3) -> CapturedStep:
    """Captured steps with ``groups`` against plain training of a copy (SGD)."""
    torch.manual_seed(0)
    model = mlp([5, 8, 7, 6, 4]).to(device)
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=3, balance=[2, 2, 4], devices=[device] * 3, schedule=schedule)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(7, 5, generator=g, dtype=torch.float64).to(device),
            torch.randn(7, 4, generator=g, dtype=torch.float64).to(device),
        )
        for _ in range(steps + 1)
    ]
    step = CapturedStep(pipe, *data[0], nn.MSELoss(), optimizer=opt, groups=groups)
    assert_trains_like(step, pipe, ref, ref_opt, data[1:])
    return step


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize("groups", [[0, 1, 1], [0, 1, 2]])
def test_captured_steps_in_groups_on_the_cpu_equal_plain_training(
    schedule: str, groups: list[int]
) -> None:
    step = _steps("cpu", schedule, groups)
    assert not step.captured and step.launches == 0


def test_groups_are_checked_at_construction() -> None:
    pipe = Pipe(mlp([5, 8, 4]), split_size=3, balance=[1, 3], devices=["cpu"] * 2)
    x, y = torch.randn(6, 5), torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"one label per stage \(2\), got 3"):
        CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 1, 1])
    with pytest.raises(ValueError, match="a memory pool of its own"):
        CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 1], pool=object())


@pytest.mark.cuda
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_captured_steps_in_groups_on_one_gpu_equal_plain_training(schedule: str) -> None:
    step = _steps("cuda:0", schedule, [0, 1, 2])
    cut = segment(step.pipe.schedule_for(3, torch.device("cuda:0"), training_step=True), [0, 1, 2])
    assert step.captured and step.launches == len(cut.parts) + 2
    with pytest.raises(RuntimeError, match="no one pool"):
        _ = step.pool


def test_dropout_in_two_groups_is_refused() -> None:
    model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.1), nn.Linear(8, 8), nn.Dropout(0.1))
    pipe = Pipe(model, split_size=3, balance=[2, 2], devices=["cpu"] * 2)
    x, y = torch.randn(6, 5), torch.randn(6, 8)
    with pytest.raises(ValueError, match=r"dropout in stage 0 \(group 0\) and stage 1 \(group 1\)"):
        CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 1])
    CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 0])  # one group draws them all
    pipe.eval()
    CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 1])  # no dropout in eval mode


@pytest.mark.cuda
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_groups_graphs_overlap_at_replay(schedule: str) -> None:
    """Calibrated GPU sleeps: the replayed segments of two groups on one GPU
    take a pipeline's time, not a serial run's."""
    from tests.cuda.helpers import SleepStage, cycles_per_ms, time_ms

    stage_ms, micros = 2.0, 8
    cycles = int(cycles_per_ms() * stage_ms)
    pipe = Pipe(
        nn.Sequential(SleepStage(cycles, cycles), SleepStage(cycles, cycles)),
        chunks=micros, devices=["cuda:0", "cuda:0"], schedule=schedule,
    )  # fmt: skip
    x, y = torch.zeros(micros, 4, device="cuda"), torch.zeros(micros, 4, device="cuda")
    step = CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 1], warmup=1)
    measured = time_ms(lambda: step(x, y))
    serial = 2 * micros * 2 * stage_ms
    ideal = 2 * (micros + 1) * stage_ms
    assert measured < 0.75 * serial, (measured, serial, ideal)
    assert measured > 0.9 * ideal, (measured, ideal)


def test_a_tensor_shared_by_two_groups_is_refused() -> None:
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight  # tied
    pipe = Pipe(nn.Sequential(first, nn.ReLU(), last), balance=[2, 1], devices=["cpu"] * 2)
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"'0.weight' of stage 0 \(group 0\) is shared with "):
        CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 1])
    CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 0])


class Noisy(nn.Module):
    """Dropout no module check can see: a functional call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, 0.5, self.training)


def test_random_numbers_drawn_in_two_groups_are_seen_in_a_step_and_refused() -> None:
    model = nn.Sequential(nn.Linear(5, 8), Noisy(), nn.Linear(8, 8), Noisy())
    pipe = Pipe(model, split_size=3, balance=[2, 2], devices=["cpu"] * 2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in pipe.parameters()]
    x, y = torch.randn(6, 5), torch.randn(6, 8)
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"random numbers in stage 0 \(group 0\) and stage 1"):
        CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt, groups=[0, 1])
    # The step that showed it is undone.
    assert all(p.grad is None for p in pipe.parameters()) and not opt.state
    for p, b in zip(pipe.parameters(), before):
        torch.testing.assert_close(p.detach(), b)
    assert torch.equal(torch.get_rng_state(), rng)
    CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt, groups=[0, 0])
    pipe.eval()
    CapturedStep(pipe, x, y, nn.MSELoss(), optimizer=opt, groups=[0, 1])  # no draws in eval


def test_a_torch_without_external_events_is_refused_up_front(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Old:
        def __new__(cls, enable_timing: bool = False, blocking: bool = False) -> Old:
            return object.__new__(cls)

    check_external_events()  # this torch has them
    monkeypatch.setattr(torch.cuda, "Event", Old)
    with pytest.raises(RuntimeError, match=r"needs torch.cuda.Event\(external=True\)"):
        check_external_events()


@pytest.mark.cuda
def test_back_to_back_replays_without_a_host_sync_train_like_eager_steps() -> None:
    """External waits bind to the producer's record of the same step, replay
    after replay, with nothing synchronising the host in between."""
    torch.manual_seed(0)
    model = mlp([5, 8, 7, 6, 4]).cuda()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=3, balance=[2, 2, 4], devices=["cuda:0"] * 3, schedule="1f1b")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(7, 5, generator=g, dtype=torch.float64).cuda(),
            torch.randn(7, 4, generator=g, dtype=torch.float64).cuda(),
        )
        for _ in range(30)
    ]
    step = CapturedStep(pipe, *data[0], nn.MSELoss(), optimizer=opt, groups=[0, 1, 2])
    losses = [step(x, y) for x, y in data]  # no host sync in between
    expected = []
    for x, y in data:
        ref_opt.zero_grad()
        loss = nn.MSELoss()(ref(x), y)
        loss.backward()
        ref_opt.step()
        expected.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected))
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())


class FailsInCapture(nn.Module):
    """Runs eagerly; inside a capture it fails, as ``how`` says."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            if self.how == "raise":
                raise ValueError("stage failed")
            x.sum().item()  # a host sync: invalidates the capture
        return x


@pytest.mark.cuda
@pytest.mark.parametrize("how", ["raise", "item"])
def test_a_capture_that_fails_in_a_segment_leaves_torch_and_the_pipe_working(how: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), FailsInCapture(how), nn.Linear(8, 4)).cuda()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_size=3, balance=[2, 1], devices=["cuda:0"] * 2)
    x, y = torch.randn(6, 5, device="cuda"), torch.randn(6, 4, device="cuda")
    expected = ValueError if how == "raise" else RuntimeError
    with pytest.raises(expected):
        CapturedStep(pipe, x, y, nn.MSELoss(), groups=[0, 1])
    assert all(p.grad is None for p in pipe.parameters())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no capture left underway in the allocator
    nn.functional.dropout(torch.ones(4, device="cuda"), 0.5)  # the generator is out of capture
    loss = pipe.train_step(x, y, nn.MSELoss())  # eager steps still work
    reference = nn.MSELoss()(ref(x), y)
    reference.backward()
    torch.testing.assert_close(loss, reference.detach())
    assert_same_grads(pipe, ref)

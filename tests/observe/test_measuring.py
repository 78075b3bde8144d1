"""What the schedule comparison measures on a real pipe leaves the pipe as
it was: its schedule, gradients and BatchNorm statistics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpstream import Pipe
from mpstream.observe import measuring
from mpstream.observe.measuring import measure_memory, profile_stages, split_cost
from mpstream.observe.tuning import tune
from mpstream.runtime.graphed import Emulated


def test_measuring_leaves_the_pipe_as_it_was() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    pipe = Pipe(model, chunks=2, balance=[2, 1], devices=["cpu"] * 2, schedule="1f1b")
    x, y = torch.randn(8, 2), torch.randn(8, 2)
    pipe.train_step(x, y, F.mse_loss)
    grads = [p.grad.clone() for p in pipe.parameters()]  # type: ignore[union-attr]
    buffers = [b.clone() for b in pipe.buffers()]
    costs = profile_stages(pipe, x, y, F.mse_loss, steps=1)
    assert len(costs.per_stage()) == 2
    memory = measure_memory(pipe, x, y, F.mse_loss, ["gpipe", "1f1b"])
    assert set(memory) == {"gpipe", "1f1b"}
    assert pipe.schedule == "1f1b"
    for p, g in zip(pipe.parameters(), grads):
        torch.testing.assert_close(p.grad, g)
    for b, saved in zip(pipe.buffers(), buffers):
        torch.testing.assert_close(b, saved)


def test_profiling_an_interleaved_pipe() -> None:
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(4)))
    pipe = Pipe(model, chunks=2, balance=[1] * 4, devices=["cpu"] * 4,
                schedule="interleaved_1f1b", virtual_stages=2)  # fmt: skip
    x, y = torch.randn(4, 2), torch.randn(4, 2)
    assert len(profile_stages(pipe, x, y, F.mse_loss, steps=1).per_stage()) == 4
    assert (pipe.schedule, pipe.virtual_stages) == ("interleaved_1f1b", 2)


@pytest.mark.parametrize("tool", ["profile_stages", "measure_memory", "tune"])
def test_a_graphed_pipes_gradients_are_put_back(tool: str) -> None:
    # A graphed stage's .grad is a view of the buffer its graphs add into:
    # the measuring steps write the very tensor the user's gradient is.
    def build() -> Pipe:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2))
        return Pipe(model, chunks=2, balance=[2, 1], devices=["cpu"] * 2, graphs=Emulated())

    pipe, twin = build(), build()
    x, y = torch.randn(8, 2), torch.randn(8, 2)
    for p in (pipe, twin):
        p.train_step(x, y, F.mse_loss)
    measure = {
        "profile_stages": lambda: profile_stages(pipe, 3 * x, y, F.mse_loss, steps=1),
        "measure_memory": lambda: measure_memory(pipe, 3 * x, y, F.mse_loss, ["gpipe"]),
        "tune": lambda: tune(
            pipe, 3 * x, F.mse_loss, [4], target=y, repeat=1, cache=None, progress=False
        ),
    }
    measure[tool]()
    for p, q in zip(pipe.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    # ... and the next step accumulates onto them, as onto the twin's.
    for p in (pipe, twin):
        p.train_step(x, y, F.mse_loss)
    for p, q in zip(pipe.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_split_cost_leaves_the_stage_as_it_was_and_refuses_no_rounds() -> None:
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    stage(torch.randn(3, 4)).sum().backward()
    grads = [p.grad.clone() for p in stage.parameters()]  # type: ignore[union-attr]
    buffers = [b.clone() for b in stage.buffers()]
    result = split_cost(stage, torch.randn(3, 4), repeat=1)
    assert set(result) == {"backward_ms", "input_ms", "weight_ms", "ratio"}
    for p, g in zip(stage.parameters(), grads):
        torch.testing.assert_close(p.grad, g)
    for b, saved in zip(stage.buffers(), buffers):
        torch.testing.assert_close(b, saved)
    with pytest.raises(ValueError, match="repeat must be an int >= 1"):
        split_cost(stage, torch.randn(3, 4), repeat=0)


def test_profile_stages_refuses_no_steps_before_running_any() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), chunks=2, devices=["cpu"] * 2)
    ran: list[int] = []
    pipe.partitions[0].register_forward_pre_hook(lambda *_: ran.append(1))
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        profile_stages(pipe, torch.randn(4, 2), torch.randn(4, 2), F.mse_loss, steps=0)
    assert not ran and pipe.schedule == "gpipe"
    profile_stages(pipe, torch.randn(4, 2), torch.randn(4, 2), F.mse_loss, steps=1)
    assert ran, "the hook sees the steps that do run"


def test_measure_memory_takes_the_pipes_own_virtual_stages() -> None:
    # Four stages on one device: a round-robin schedule needs virtual_stages,
    # and the pipe's own serves where none is given.
    model = nn.Sequential(*(nn.Linear(3, 3) for _ in range(4)))
    pipe = Pipe(model, chunks=2, balance=[1] * 4, devices=["cpu"] * 4,
                schedule="interleaved_1f1b", virtual_stages=2)  # fmt: skip
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    memory = measure_memory(pipe, x, y, F.mse_loss, ["interleaved_1f1b", "gpipe"])
    assert set(memory) == {"interleaved_1f1b", "gpipe"}
    assert (pipe.schedule, pipe.virtual_stages) == ("interleaved_1f1b", 2)


@pytest.mark.parametrize("tool", ["profile_stages", "measure_memory"])
def test_measuring_keeps_the_random_state_and_what_auto_chose(tool: str) -> None:
    # Dropout masks of the next real step do not depend on whether anything
    # was measured, and schedule='auto' does not measure again to choose.
    model = nn.Sequential(nn.Linear(2, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    pipe = Pipe(model, chunks=2, balance=[2, 1], devices=["cpu"] * 2, schedule="auto")
    x, y = torch.randn(8, 2), torch.randn(8, 2)
    pipe.train_step(x, y, F.mse_loss)
    chosen = pipe.schedule_report()
    state = torch.get_rng_state()
    if tool == "profile_stages":
        profile_stages(pipe, x, y, F.mse_loss, steps=1)
    else:
        measure_memory(pipe, x, y, F.mse_loss, ["gpipe"])
    assert torch.equal(torch.get_rng_state(), state)
    assert pipe.schedule == "auto" and pipe.schedule_report() is chosen


def test_a_pipe_on_the_cpu_and_a_gpu_reports_every_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    # Stage 1 stands on a (fake) GPU: its device's allocator peak is read,
    # and stage 0, on the CPU, still gets its saved-for-backward bytes.
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(3, 5), nn.Tanh()), nn.Linear(5, 2)]
    x = torch.randn(4, 3)
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(f"reset {d}"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 123)

    def step() -> None:
        calls.append("step")
        stages[1](stages[0](x)).sum().backward()

    cpu = measuring._peaks([torch.device("cpu")] * 2, stages, step)
    assert set(cpu) == {"stage0", "stage1"} and cpu["stage0"] > 0 and calls == ["step"]
    calls.clear()
    mixed = measuring._peaks([torch.device("cpu"), torch.device("cuda:0")], stages, step)
    assert mixed == {"cuda:0": 123, "stage0": cpu["stage0"]}
    assert calls == ["reset cuda:0", "step", "step"]


@pytest.mark.parametrize(("rows", "share"), [(8, 1.0), (7, 0.75), (5, 0.25)])
def test_profile_stages_fits_a_short_last_micro_batch_as_its_share(
    rows: int, share: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The medians took a short last micro-batch as a full one's cost.
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), split_size=4,
                balance=[1, 1], devices=["cpu"] * 2)  # fmt: skip
    fitted = measuring.fit
    seen: list[float] = []

    def spy(timeline: object, last_size: float = 1.0) -> object:
        seen.append(last_size)
        return fitted(timeline, last_size=last_size)  # type: ignore[arg-type]

    monkeypatch.setattr(measuring, "fit", spy)
    profile_stages(pipe, torch.randn(rows, 2), torch.randn(rows, 2), F.mse_loss, steps=1)
    assert seen == [share]

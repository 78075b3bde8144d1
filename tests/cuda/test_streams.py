"""Which stream runs what: each stage on its own, transfers on the io stream,
forced copies on the sender's copy stream, streams restored after a failure,
timing events, a call made from another stream than the last one's, a
call after a backward that copied an input's gradient to another GPU.

Marked ``cuda``: skipped cleanly without a GPU."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.pipe import call
from mpstream.runtime import copy as copies
from mpstream.runtime import forward, gathering, transfer
from tests.cuda.helpers import (
    BATCH,
    cycles_per_ms,
    two_gpus,
)
from tests.helpers import mlp

pytestmark = pytest.mark.cuda


def test_streams_are_restored_after_a_failure() -> None:
    class Fail(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            raise RuntimeError("boom")

    pipe = Pipe(nn.Sequential(nn.Linear(2, 2).cuda(), Fail()), chunks=2)
    before = torch.cuda.current_stream()
    with pytest.raises(RuntimeError, match="boom"):
        pipe(torch.ones(4, 2, device="cuda"))
    assert torch.cuda.current_stream() == before
    assert pipe.scheduler.events_free == pipe.scheduler.events_created


def test_stages_run_on_their_own_streams() -> None:
    seen: list[tuple[int, int]] = []

    class Spy(nn.Module):
        def __init__(self, stage: int) -> None:
            super().__init__()
            self.stage = stage
            self.lin = nn.Linear(2, 2)

        def forward(self, x: Tensor) -> Tensor:
            seen.append((self.stage, torch.cuda.current_stream().stream_id))
            return self.lin(x)

    pipe = Pipe(nn.Sequential(Spy(0), Spy(1)).cuda(), chunks=3)
    pipe(torch.ones(6, 2, device="cuda"))
    streams = pipe.scheduler.compute_streams
    assert all(sid == streams[s].stream_id for s, sid in seen)
    assert streams[0] != streams[1] != torch.cuda.default_stream()
    # Compute outranks copies: a same-GPU copy kernel must not hold the SMs.
    copies = pipe.scheduler.copy_streams
    assert all(s.priority < c.priority for s, c in zip(streams, copies))


def test_timing_events_cover_every_task() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).cuda(), chunks=4)
    sched = pipe.scheduler
    sched.timing = True
    pipe(torch.randn(8, 8, device="cuda"))
    timings = sched.timings()
    sched.timing = False
    assert {(t.stage, t.micro) for t in timings} == {(s, m) for s in range(2) for m in range(4)}
    assert all(t.end_ms >= t.start_ms >= 0 for t in timings)
    assert all(t.issue_ms > 0 for t in timings)


def test_issue_times_measure_the_host_not_the_device() -> None:
    class Slow(nn.Module):
        """Issues one kernel after 20 ms of host work."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.02)
            return x + 1

    pipe = Pipe(
        nn.Sequential(Slow(), nn.Identity()), chunks=2, balance=[1, 1], devices=["cuda:0"] * 2
    )
    sched = pipe.scheduler
    sched.timing = True
    pipe(torch.randn(8, 8, device="cuda"))
    timings = sched.timings()
    sched.timing = False
    slow = [t for t in timings if t.stage == 0]
    assert len(slow) == 2 and all(t.issue_ms >= 19 for t in slow)
    assert all(t.issue_ms < 10 for t in timings if t.stage == 1)


def _stream_spy(monkeypatch: pytest.MonkeyPatch, module: str, name: str) -> list[int]:
    """Records the current stream's id whenever ``module.name`` is called."""
    import importlib

    target = importlib.import_module(module)
    real = getattr(target, name)
    seen: list[int] = []

    def spy(x: Tensor, device: torch.device, *args: object, **kwargs: object) -> Tensor:
        where = device if device.type == "cuda" else x.device
        seen.append(torch.cuda.current_stream(where).stream_id)
        return real(x, device, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(target, name, spy)
    return seen


def test_inputs_and_targets_move_on_the_io_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = Pipe(mlp([5, 8, 4]).float().cuda(), chunks=3, balance=[2, 2], devices=["cuda:0"] * 2)
    io = pipe.scheduler.io_streams[0].stream_id  # type: ignore[union-attr]
    # Inputs move in copy tasks (runtime/copy.py), in pipe(x) and train_step
    # alike; targets in the training step's target tasks, one micro-batch a call.
    inputs = _stream_spy(monkeypatch, "mpstream.runtime.copy", "to_device")
    targets = _stream_spy(monkeypatch, "mpstream.runtime.training", "micro_to_device")
    x, y = torch.randn(BATCH, 5), torch.randn(BATCH, 4)
    pipe(x).sum().backward()
    pipe.train_step(x.pin_memory(), y, nn.MSELoss())
    assert inputs == [io] * 6  # 3 in pipe(x), 3 in train_step
    assert targets == [io] * 3
    sched = pipe.scheduler
    sched.timing = True
    pipe.train_step(x, y, nn.MSELoss())
    spans = sched.timings()
    sched.timing = False
    transfers = [t for t in spans if (t.kind, t.stage) == ("copy", -1) or t.kind == "target"]
    assert len(transfers) == 6 and {t.stream for t in transfers} == {"io@cuda:0"}


def test_forced_copies_run_on_the_sending_copy_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = Pipe(
        mlp([5, 8, 7, 4]).float().cuda(), chunks=2, balance=[2, 2, 2], devices=["cuda:0"] * 3,
        force_copies=True,
    )  # fmt: skip
    copies = [st.stream_id for st in pipe.scheduler.copy_streams]  # type: ignore[union-attr]
    seen = _stream_spy(monkeypatch, "mpstream.runtime.copy", "send")
    x = torch.randn(BATCH, 5, device="cuda")
    out = pipe(x)
    assert seen == [copies[0], copies[0], copies[1], copies[1]]  # stage 0 -> 1, then 1 -> 2
    seen.clear()
    out.sum().backward()
    # Gradients go back on the stream of each forward copy's autograd node,
    # which autograd made wait for the incoming gradient.
    assert sorted(seen) == sorted([copies[0], copies[0], copies[1], copies[1]])


def test_a_failed_step_restores_state_after_its_queued_kernels() -> None:
    """loss_fn fails after the last stage's kernels were queued: the restore
    (on the caller's stream) is ordered after them, and the next step works."""
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 8)).cuda()
    pipe = Pipe(model, split_size=4, balance=[2, 1], devices=["cuda:0"] * 2, schedule="1f1b")
    x, y = torch.randn(16, 64, device="cuda"), torch.randn(16, 8, device="cuda")
    pipe.train_step(x, y, nn.MSELoss())
    grads = [p.grad.clone() for p in pipe.parameters()]  # type: ignore[union-attr]
    stats = [b.clone() for b in pipe.buffers()]
    with pytest.raises(TypeError, match="scalar"):
        pipe.train_step(x, y, nn.MSELoss(reduction="none"))
    for p, g in zip(pipe.parameters(), grads):
        torch.testing.assert_close(p.grad, g)
    for b, saved in zip(pipe.buffers(), stats):
        torch.testing.assert_close(b, saved)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    pipe.train_step(x, y, nn.MSELoss())


def test_timing_events_are_pooled() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).cuda(), chunks=4)
    sched = pipe.scheduler
    sched.timing = True
    x = torch.randn(8, 8, device="cuda")
    for _ in range(30):
        pipe(x)
        torch.cuda.synchronize()
    assert len(sched.timings()) == 30 * 8
    sched.timing = False
    # Two events per task of one run (and the run in flight), not per run.
    assert sched.timing_events_created <= 2 * 2 * 8


def test_too_many_stages_on_one_gpu_warn_about_shared_streams() -> None:
    from mpstream.runtime.scheduler import StreamAliasWarning

    # PyTorch pools 32 streams per priority and device; compute streams
    # have a pool of their own (high priority), so 40 stages must share.
    layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(40)]).cuda()
    pipe = Pipe(layers, balance=[1] * 40, devices=["cuda:0"] * 40)
    with pytest.warns(StreamAliasWarning, match="stage0.compute@cuda:0 = "):
        assert pipe.scheduler is not None


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward first spins its stream for ``cycles``."""

    @staticmethod
    def forward(ctx: object, x: Tensor, cycles: int) -> Tensor:  # type: ignore[override]
        ctx.cycles = cycles  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        torch.cuda._sleep(ctx.cycles)  # type: ignore[attr-defined]
        return grad.clone(), None


class SlowBackward(nn.Module):
    """A slow backward on the GPU (a stage's adds into .grad come late); the
    identity on the CPU, for the reference."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.cycles = cycles

    def forward(self, x: Tensor) -> Tensor:
        return _SlowBackward.apply(x, self.cycles) if x.is_cuda else x  # type: ignore[no-any-return]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphed"])
def test_zero_grad_in_place_in_a_loss_fn_is_ordered_after_earlier_adds(graphs: bool) -> None:
    """1F1B, two stages on one GPU: stage 0's backward of micro-batch 0 is
    issued before the loss of micro-batch 1, which zeroes the gradients in
    place on stage 1's stream. Stage 0's add of micro-batch 0, late on its
    own stream, must not land after the zeroing (nor its later adds before)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), SlowBackward(int(20 * cycles_per_ms())),
        nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2),
    ).double()  # fmt: skip
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    ref = copy.deepcopy(model)
    # The adds after the zeroing: micro-batches 1 to 3 of 4, on both stages.
    later = [nn.functional.mse_loss(ref(x[m : m + 2]), y[m : m + 2]) for m in (2, 4, 6)]
    (sum(later) / 4).backward()
    pipe = Pipe(
        model.cuda(), chunks=4, balance=[3, 3], devices=["cuda:0"] * 2, schedule="1f1b",
        graphs=graphs,
    )  # fmt: skip
    calls = [0]

    def loss(out: Tensor, target: Tensor) -> Tensor:
        calls[0] += 1
        if calls[0] % 4 == 2:
            pipe.zero_grad(set_to_none=False)
        return nn.functional.mse_loss(out, target)

    for _ in range(3):  # graphed: the first step captures, the others replay
        pipe.train_step(x.cuda(), y.cuda(), loss)
        for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, msg=name)  # type: ignore[union-attr]


def _slowed(fn: Any, cycles: int) -> Any:
    """``fn``, after spinning the current stream for ``cycles``."""

    def slow(*args: Any) -> Any:
        torch.cuda._sleep(cycles)
        return fn(*args)

    return slow


@pytest.mark.parametrize("chunks", [1, 2], ids=["copied", "concatenated"])
def test_a_call_from_another_stream_leaves_the_last_outputs_alone(
    chunks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Graphed, without gradients: a call's outputs are the replays' buffers
    until its caller's stream concatenates them (or copies one micro-batch's).
    That read, slowed on stream ``a``, must come before the next call, made
    from stream ``b``, replays into the same buffers (runtime/callers.py)."""
    torch.manual_seed(0)
    model = mlp([8, 16, 16, 4]).float().cuda()
    pipe = Pipe(model, chunks=chunks, balance=[4, 2], devices=["cuda:0"] * 2, graphs=True)
    x1, x2 = torch.randn(4, 8, device="cuda"), torch.randn(4, 8, device="cuda")
    with torch.no_grad():
        want = model(x1)
        for _ in range(3):  # captured, then replayed
            pipe(x2)
    torch.cuda.synchronize()
    cycles = int(50 * cycles_per_ms())
    monkeypatch.setattr(call, "gather", _slowed(gathering.gather, cycles))
    monkeypatch.setattr(forward, "_copied", _slowed(forward._copied, cycles))
    a, b = torch.cuda.Stream(), torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        with torch.cuda.stream(a):
            out = pipe(x1)
        with torch.cuda.stream(b):
            pipe(x2)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphed"])
def test_a_step_from_another_stream_waits_for_the_last_callers_read_of_the_gradients(
    graphs: bool,
) -> None:
    """The gradients one step left, read late on stream ``a`` (an optimizer
    step), must not take the adds of the next step, made from stream ``b``
    (a graphed stage's ``.grad`` is the buffer its graphs add into)."""
    torch.manual_seed(0)
    model = mlp([8, 16, 16, 4]).float()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    nn.functional.mse_loss(ref(x), y).backward()
    pipe = Pipe(model.cuda(), chunks=2, balance=[4, 2], devices=["cuda:0"] * 2, graphs=graphs)
    x, y = x.cuda(), y.cuda()
    for _ in range(3):  # graphed: captured, then replayed
        pipe.train_step(x, y, nn.MSELoss())
        pipe.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    a, b = torch.cuda.Stream(), torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(a):
        pipe.train_step(x, y, nn.MSELoss())
        torch.cuda._sleep(int(50 * cycles_per_ms()))
        read = [p.grad.clone() for p in pipe.parameters()]  # type: ignore[union-attr]
    with torch.cuda.stream(b):
        pipe.train_step(x, y, nn.MSELoss())  # adds into the same .grad
    torch.cuda.synchronize()
    for (name, _), got, q in zip(pipe.named_parameters(), read, ref.parameters()):
        torch.testing.assert_close(got.cpu(), q.grad, msg=name)


@two_gpus
def test_a_call_after_an_input_gradient_copied_to_another_gpu_waits_for_that_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Graphed stages on cuda:0, input on cuda:1: the input's gradient is
    stage 0's static buffer, copied back on cuda:0's io stream (slowed
    here). The next call, its input on cuda:0 (no input copy on that io
    stream to order it), must not replay the backward into that buffer
    before the copy read it (runtime/callers.py, note_read)."""
    torch.manual_seed(0)
    model = mlp([8, 16, 16, 4]).float()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, chunks=2, balance=[4, 2], devices=["cuda:0"] * 2, graphs=True)
    x = torch.randn(4, 8)
    x_ref = x.clone().requires_grad_()
    ref(x_ref).sum().backward()

    def backward(device: str, scale: float) -> Tensor:
        given = x.to(device).requires_grad_()
        (pipe(given).sum() * scale).backward()
        return given

    for _ in range(3):  # captured, then replayed; both ways share stage 0's graphs
        backward("cuda:1", 1.0)
        backward("cuda:0", 1.0)
    torch.cuda.synchronize()
    cycles = int(50 * cycles_per_ms())
    monkeypatch.setattr(copies, "to_host", _slowed(transfer.to_host, cycles))
    first = backward("cuda:1", 1.0)
    backward("cuda:0", 3.0)  # its backward writes three times the gradient into the buffer
    torch.cuda.synchronize()
    torch.testing.assert_close(first.grad.cpu(), x_ref.grad)  # type: ignore[union-attr]

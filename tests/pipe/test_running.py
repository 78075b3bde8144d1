"""One call of a Pipe at a time: a call from another thread, or from inside
a running call, is refused before it changes anything, so the running
call's BatchNorm statistics and failure snapshot stay its own."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.pipe import running

X, Y = torch.randn(12, 8), torch.randn(12, 4)


class Pause(nn.Module):
    """Runs ``inside`` at its second forward (micro-batch 1) once armed."""

    def __init__(self) -> None:
        super().__init__()
        self.inside: Callable[[], None] | None = None
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.inside is not None and self.calls == 2:
            self.inside()
        return x


def pipes(deferred: bool) -> tuple[Pipe, Pause, Pipe]:
    """A pipe with a :class:`Pause` after its first BatchNorm, the pause,
    and a copy of the pipe."""
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), Pause(), nn.Linear(16, 4))
    made = [
        Pipe(
            copy.deepcopy(model),
            chunks=3,
            balance=[3, 1],
            devices=["cpu", "cpu"],
            deferred_batch_norm=deferred,
        )
        for _ in range(2)
    ]
    pause = made[0][2]
    assert isinstance(pause, Pause)
    return made[0], pause, made[1]


def run(pipe: Pipe, step: bool) -> None:
    if step:
        pipe.train_step(X, Y, nn.MSELoss())
    else:
        pipe(X).sum().backward()


def assert_same_state(pipe: Pipe, ref: Pipe) -> None:
    for (name, a), b in zip(pipe.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("step", [True, False], ids=["train_step", "forward"])
def test_a_call_from_another_thread_is_refused_and_the_running_call_is_untouched(
    step: bool, deferred: bool
) -> None:
    pipe, pause, ref = pipes(deferred)
    run(ref, step)
    paused, resume = threading.Event(), threading.Event()

    def wait() -> None:
        paused.set()
        resume.wait(10)

    pause.inside = wait
    first = threading.Thread(target=run, args=(pipe, step))
    first.start()
    try:
        assert paused.wait(10)
        with pytest.raises(RuntimeError, match="from another thread while a call of this Pipe"):
            run(pipe, step)
    finally:
        resume.set()
        first.join()
    # Refused before it touched the first call's deferred statistics.
    assert_same_state(pipe, ref)


def test_a_call_from_inside_a_running_call_is_refused_and_its_failure_puts_all_back() -> None:
    pipe, pause, _ = pipes(deferred=False)
    pipe.train_step(X, Y, nn.MSELoss())
    before = copy.deepcopy(pipe.state_dict())
    grads = [p.grad.clone() for p in pipe.parameters() if p.grad is not None]

    def reenter() -> None:
        pipe.train_step(X, Y, nn.MSELoss())

    pause.calls, pause.inside = 0, reenter
    with pytest.raises(RuntimeError, match="while a call of the same Pipe runs in this thread"):
        pipe.train_step(X, Y, nn.MSELoss())
    # The outer step's snapshot was its own: micro-batch 0's statistics are undone.
    for (name, a), b in zip(pipe.state_dict().items(), before.values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    torch.testing.assert_close([p.grad for p in pipe.parameters()], grads)
    pause.inside = None
    pipe.train_step(X, Y, nn.MSELoss())  # the next call runs


def test_a_copied_pipe_runs_beside_its_original() -> None:
    pipe, pause, _ = pipes(deferred=False)
    inner = copy.deepcopy(pipe)
    pause.calls, pause.inside = 0, lambda: inner(X).sum().backward()
    run(pipe, step=True)
    assert pause.calls == 3


def test_the_first_calls_of_a_pipe_from_two_threads_share_one_guard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The guard is made at the first call: two threads making it at once
    # must both hold the same one, or each would run beside the other.
    made = threading.Barrier(2)
    init = running.Running.__init__

    def both_make_one(self: running.Running) -> None:
        init(self)
        made.wait(timeout=10)  # neither keeps its guard before both have one

    monkeypatch.setattr(running.Running, "__init__", both_make_one)
    pipe = Pipe(nn.Sequential(nn.Linear(8, 4)), chunks=2)
    found: list[running.Running] = []

    def first_call() -> None:
        found.append(running.running_of(pipe))

    threads = [threading.Thread(target=first_call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(found) == 2 and found[0] is found[1]

"""Gradients of a parameter that more than one gradient store holds: the
splits of a traced pipe's two kinds of call, each with its own stores, and
a weight tied after the first capture (replays emulated on the CPU, see
test_stages.py; a take-over's stream order on fake streams, and on a GPU)."""

from __future__ import annotations

import copy
import threading
from collections import Counter, defaultdict
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated, attaching, grads
from mpstream.runtime.graphed.call import GraphedCall
from mpstream.runtime.graphed.grads import GradStore
from tests.helpers import assert_same_grads, mlp


class Masked(nn.Module):
    """Two kinds of call: with a mask and without (two traced splits)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        h = self.a(x)
        if mask is not None:
            h = h * mask
        return self.b(h)  # type: ignore[no-any-return]


def test_two_kinds_of_call_interleaved_in_one_backward_add_every_gradient() -> None:
    # The second kind's stores take .grad over from the first's within the
    # pass; the first kind's next replay must add into .grad, not into its
    # own view that .grad no longer is.
    model = Masked().double()
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu", "cpu"], chunks=2,
        graphs=Emulated(),
    )  # fmt: skip
    x, x2, mask = (torch.randn(4, 4, dtype=torch.float64) for _ in range(3))
    for _ in range(2):  # the second pass replays
        for m in (model, pipe):
            m.zero_grad()
            outs = [m(x), m(x, mask), m(x2)]  # later calls' backwards run first
            sum(y.square().sum() for y in outs).backward()
        for (name, p), q in zip(pipe.named_parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)


def _three_stages(model: nn.Sequential) -> tuple[Pipe, Tensor, Tensor]:
    """A pipe of a copy of ``model`` (``mlp([5, 5, 5, 5])``) in three stages
    of two layers, replays emulated, and a batch of 7 rows with its targets."""
    pipe = Pipe(
        copy.deepcopy(model), chunks=3, balance=[2, 2, 2], devices=["cpu"] * 3,
        graphs=Emulated(),
    )  # fmt: skip
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)
    return pipe, x, y


def _tied_after_capture() -> tuple[nn.Sequential, Pipe, Tensor, Tensor]:
    """A model and its :func:`_three_stages` pipe, each run forward and
    backward once (the pipe captures), then layer 4's weight tied to layer
    0's: stage 0's store holds it as its own, stage 2's new store in a side
    buffer."""
    model = mlp([5, 5, 5, 5])
    pipe, x, y = _three_stages(model)
    for m in (model, pipe):
        nn.functional.mse_loss(m(x), y).backward()  # captures
        m[4].weight = m[0].weight
    return model, pipe, x, y


def test_a_weight_tied_after_the_first_capture_is_added_after_every_stage_s_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Tied after stage 0's store was made: the weight is stage 0's own
    # (.grad is its view, which its graphs add into on its stream) and in a
    # side buffer of stage 2's new store. Stage 2's flush, autograd's first
    # final callback, must not add its side buffer into .grad before stage
    # 0's flush has ordered the caller's stream after stage 0's graphs: on
    # a GPU the two adds would race. No flush may change that .grad.
    model, pipe, x, y = _tied_after_capture()
    changed: list[bool] = []
    flush = GradStore.flush

    def watched(store: GradStore, autograd: bool = True) -> None:
        g = pipe[0].weight.grad
        before = None if g is None else g.clone()
        flush(store, autograd)
        g = pipe[0].weight.grad
        changed.append(before is None or g is None or not torch.equal(g, before))

    monkeypatch.setattr(GradStore, "flush", watched)
    for _ in range(2):  # the second pass replays stage 2's new graphs
        for m in (model, pipe):
            nn.functional.mse_loss(m(x), y).backward()
        for (name, p), q in zip(pipe.named_parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert changed and not any(changed)


def test_a_hook_raising_in_the_last_flush_leaves_later_tied_gradients_whole() -> None:
    # The tied weight's side buffer waits for a final callback queued behind
    # every store's flush; a hook raising in the last flush drops it, and
    # the next pass must queue its own.
    model = mlp([5, 5, 5, 5])
    model[4].weight = model[0].weight
    pipe, x, y = _three_stages(model)
    nn.functional.mse_loss(pipe(x), y).backward()  # captures
    failing = [True]

    def hook(p: Tensor) -> None:
        if failing.pop() if failing else False:
            raise RuntimeError("hook failed")

    pipe[0].bias.register_post_accumulate_grad_hook(hook)  # stage 0's: the last flush
    with pytest.raises(RuntimeError, match="hook failed"):
        nn.functional.mse_loss(pipe(x), y).backward()
    for m in (model, pipe):
        m.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
    for (name, p), q in zip(pipe.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("train_step", [False, True])
def test_a_weight_tied_after_the_first_capture_runs_its_hook_once_per_pass(
    train_step: bool,
) -> None:
    # Stage 0's store holds the weight as its own, stage 2's new store in a
    # side buffer: its hook runs once, with the whole gradient, as when the
    # weights were tied from the start (not also after stage 0's adds).
    model, pipe, x, y = _tied_after_capture()
    seen: list[Tensor] = []
    pipe[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    for _ in range(2):  # the second pass replays stage 2's new graphs
        seen.clear()
        for m in (model, pipe):
            m.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if train_step:
            pipe.train_step(x, y, nn.MSELoss())
        else:
            nn.functional.mse_loss(pipe(x), y).backward()
        assert len(seen) == 1
        torch.testing.assert_close(seen[0], model[0].weight.grad)


class Swapped(nn.Module):
    """Two kinds of call that put ``a`` in different stages (split at ``b``):
    without ``flip`` stage 0 is ``c, a``; with it, stage 1 is ``b, a``."""

    def __init__(self, width: int = 4, delay: nn.Module | None = None) -> None:
        super().__init__()
        self.c, self.a, self.b = (nn.Linear(width, width) for _ in range(3))
        self.delay = delay or nn.Identity()

    def forward(self, x: Tensor, flip: Tensor | None = None) -> Tensor:
        h = self.delay(self.c(x))
        if flip is None:
            return self.b(self.a(h))  # type: ignore[no-any-return]
        return self.a(self.b(h) * flip)  # type: ignore[no-any-return]


def interleaved(m: nn.Module, x: Tensor, x2: Tensor, flip: Tensor) -> None:
    """One backward through both kinds, the second's replays between the first's."""
    m.zero_grad()
    outs = [m(x), m(x, flip), m(x2)]  # later calls' backwards run first
    sum(y.square().sum() for y in outs).backward()


class FakeStream:
    """A stage's CUDA stream (or the caller's) stand-in: logs its waits."""

    def __init__(self, name: str, log: list[tuple[str, str, Any]]) -> None:
        self.name, self.log = name, log
        self.stream_id, self.device = id(self), torch.device("cpu")

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait", self.name, other.name))


def unordered_reads(log: list[tuple[str, str, Any]]) -> tuple[list[str], set[tuple[str, int]]]:
    """The reads of a buffer that no wait orders after the last write to it
    on another stream (vector clocks over the log), and each cross-stream
    read as (reading stream, buffer)."""
    seen: defaultdict[str, dict[str, int]] = defaultdict(dict)  # what each stream waited for
    issued: Counter[str] = Counter()
    written: dict[int, tuple[str, int]] = {}
    bad, crossed = [], set()
    for op, stream, what in log:
        issued[stream] += 1
        seen[stream][stream] = issued[stream]
        if op == "wait":
            for other, n in seen[what].items():
                seen[stream][other] = max(seen[stream].get(other, 0), n)
        elif op in ("copy", "add"):
            reads, writes = what
            for t in reads:
                if t in written and written[t][0] != stream:
                    crossed.add((stream, t))
                    if seen[stream].get(written[t][0], 0) < written[t][1]:
                        bad.append(f"{stream} read what {written[t][0]} wrote, unordered")
            for t in writes:
                written[t] = (stream, issued[stream])
    return bad, crossed


def test_a_take_over_from_another_kind_s_stage_waits_for_its_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 'a' is stage 0's in one kind, stage 1's in the other: on one GPU the
    # two stores add on two streams. A store taking a.grad over copies the
    # other's view: after a wait on the stream that other's graphs added
    # on, and with the view marked for the copying stream.
    log: list[tuple[str, str, Any]] = []
    streams: dict[str, FakeStream] = {}
    current = [FakeStream("caller", log)]

    def on_stage_stream(method: Any) -> Any:
        def run(call: GraphedCall, *args: Any, **kwargs: Any) -> Any:
            before = current[0]
            current[0] = streams.setdefault(call.label, FakeStream(call.label, log))
            try:
                return method(call, *args, **kwargs)
            finally:
                current[0] = before

        return run

    def logged(op: str, foreach: Any) -> Any:
        def run(dst: list[Tensor], src: list[Tensor]) -> None:
            reads = [id(t) for t in src] + ([id(t) for t in dst] if op == "add" else [])
            log.append((op, current[0].name, (reads, [id(t) for t in dst])))
            foreach(dst, src)

        return run

    marks: set[tuple[str, int]] = set()
    monkeypatch.setattr(grads, "current_stream", lambda device: current[0])
    monkeypatch.setattr(attaching, "record_stream", lambda t, s: marks.add((s.name, id(t))))
    for name in ("backward", "weight"):
        monkeypatch.setattr(GraphedCall, name, on_stage_stream(getattr(GraphedCall, name)))
    monkeypatch.setattr(torch, "_foreach_copy_", logged("copy", torch._foreach_copy_))
    monkeypatch.setattr(torch, "_foreach_add_", logged("add", torch._foreach_add_))
    model = Swapped().double()
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cpu", "cpu"], chunks=2,
        graphs=Emulated(),
    )  # fmt: skip
    x, x2, flip = (torch.randn(4, 4, dtype=torch.float64) for _ in range(3))
    for _ in range(2):  # the second pass replays
        log.clear()
        for m in (model, pipe):
            interleaved(m, x, x2, flip)
        assert_same_grads(pipe, model)
    bad, crossed = unordered_reads(log)
    assert not bad, bad
    assert crossed, "no store took a .grad over from another stream's"
    assert crossed <= marks


class CountingChecks:
    """A store's ``Attached`` that counts how often it was asked."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def detached(self) -> list[int]:
        self.calls += 1
        return self.inner.detached()  # type: ignore[no-any-return]


def test_one_pipe_s_take_over_makes_no_other_pipe_s_store_check_again() -> None:
    # Pipe 1 takes over a .grad set by hand within a backward that runs
    # pipe 2's replays before and after: pipe 2's stores check their
    # parameters once in the pass, not again (and once at its end, for a
    # .grad changed unseen: test_grads_zeroing.py).
    models = [mlp([5, 5, 5]) for _ in range(2)]
    pipes = [
        Pipe(copy.deepcopy(m), balance=[2, 2], devices=["cpu"] * 2, graphs=Emulated())
        for m in models
    ]
    x, x2 = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)

    def run(one: nn.Module, two: nn.Module) -> None:
        for m in (one, two):
            m.zero_grad()
        one[0].weight.grad = torch.ones_like(one[0].weight)
        (two(x).sum() + one(x).sum() + two(x2).sum()).backward()  # backward: two, one, two

    for _ in range(2):  # captures, then replays
        run(*models)
        run(*pipes)
    graphs = pipes[1]._rt().worker.graphs
    assert graphs is not None
    stores = [st.store for st in graphs.stages if st.store is not None]
    counting = [CountingChecks(store._attached) for store in stores]
    for store, checks in zip(stores, counting):
        store._attached = checks
    run(*models)
    run(*pipes)
    assert [c.calls for c in counting] == [2, 2]
    for pipe, model in zip(pipes, models):
        assert_same_grads(pipe, model)


def test_a_take_over_while_the_store_taken_from_checks_is_not_missed() -> None:
    # Another thread takes the .grad over from store `one` while `one`
    # checks its parameters, after the check read them: `one` checks again
    # before its next replay within the pass, and attaches them back.
    params = list(nn.Linear(3, 3).double().parameters())
    one, two = GradStore(params), GradStore(params)
    reached, token = frozenset(range(len(params))), object()
    one.ensure(reached, object())  # the views are .grad
    checks = one._attached

    class Interrupted:
        def detached(self) -> list[int]:
            found = checks.detached()
            thread = threading.Thread(target=two.ensure, args=(reached, token))
            thread.start()
            thread.join()
            return found  # type: ignore[no-any-return]

    one._attached = Interrupted()
    one.ensure(reached, token)
    assert all(p.grad is v for p, v in zip(params, two.views))
    one._attached = checks
    one.ensure(reached, token)
    assert all(p.grad is v for p, v in zip(params, one.views))


class Delay(torch.autograd.Function):
    """Its backward keeps the stream busy before the stage's gradient adds."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:  # type: ignore[override]
        torch.cuda._sleep(50_000_000)  # tens of milliseconds
        return g


class Delayed(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return Delay.apply(x)  # type: ignore[no-any-return]


@pytest.mark.cuda
def test_cuda_a_take_over_from_another_kind_s_stage_reads_its_whole_gradient() -> None:
    # Without flip, stage 0's backward graphs (stream 0) add a's gradient
    # after a long wait; the flipped kind's stage 1 (stream 1) then takes
    # a.grad over. Unordered, its copy reads the view before those adds.
    torch.manual_seed(0)
    model = Swapped(64, Delayed()).double().cuda()
    pipe = Pipe(
        copy.deepcopy(model), split_points=["b"], devices=["cuda:0", "cuda:0"], chunks=2,
        graphs=True, leaf_modules=[Delayed],
    )  # fmt: skip
    x, x2, flip = (torch.randn(8, 64, dtype=torch.float64, device="cuda") for _ in range(3))
    for _ in range(3):  # captures, then replays
        for m in (model, pipe):
            interleaved(m, x, x2, flip)
        assert_same_grads(pipe, model)
    assert all(s.graphed for s in pipe.graph_report().stages), pipe.graph_report()

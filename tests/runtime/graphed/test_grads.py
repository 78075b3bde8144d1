"""A graphed stage's parameter gradients are added inside its graphs into
buffers of its own, which the parameters' ``.grad`` are: PyTorch's ``.grad``
semantics (accumulation across passes and steps, ``zero_grad`` either way,
a tensor set by hand, optimizers' foreach and fused paths), one zeroing per
step at most, no per-parameter work per task, and a failed step or backward
leaves nothing half-added. Hooks on the gradients: test_grads_hooks.py."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated
from mpstream.runtime.graphed import grads as grads_module
from tests.helpers import Ops, assert_same_grads, mlp
from tests.runtime.graphed.pairs import WIDTHS, data, pair


def user_loop(pipe: Pipe, x: Tensor, y: Tensor) -> None:
    nn.functional.mse_loss(pipe(x), y).backward()


def step(pipe: Pipe, x: Tensor, y: Tensor) -> None:
    pipe.train_step(x, y, nn.MSELoss())


RUNS: dict[str, Callable[[Pipe, Tensor, Tensor], None]] = {"loop": user_loop, "step": step}


def views(pipe: Pipe) -> list[Tensor]:
    """Every graphed stage's gradient buffers, per parameter."""
    graphs = pipe._rt().worker.graphs
    assert graphs is not None
    return [v for st in graphs.stages if st.store is not None for v in st.store.views]


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_grad_accumulates_across_passes_until_zero_grad(run: str, schedule: str) -> None:
    eager, graphed = pair(mlp(WIDTHS), chunks=4, schedule=schedule)
    x, y = data()
    for i in range(5):
        if i == 2:
            for pipe in (eager, graphed):
                pipe.zero_grad(set_to_none=True)
        if i == 4:
            for pipe in (eager, graphed):
                pipe.zero_grad(set_to_none=False)
        for pipe in (eager, graphed):
            RUNS[run](pipe, x, y)
        assert_same_grads(graphed, eager)
        # .grad is the graphs' buffer: nothing copied out, nothing re-added.
        assert all(p.grad is v for p, v in zip(graphed.parameters(), views(graphed)))


@pytest.mark.parametrize("run", RUNS)
def test_grad_is_the_buffer_the_graphs_add_into(run: str) -> None:
    _, graphed = pair(mlp(WIDTHS), chunks=2)
    x, y = data()
    RUNS[run](graphed, x, y)
    grads = [p.grad for p in graphed.parameters()]
    assert all(g is v for g, v in zip(grads, views(graphed)))
    graphed.zero_grad(set_to_none=True)
    RUNS[run](graphed, x, y)
    assert all(p.grad is v for p, v in zip(graphed.parameters(), views(graphed)))


class Silent(Emulated):
    """Replays that do nothing: what is left is the host's work around them."""

    def replay(self, call: object, name: str) -> None:
        pass


@pytest.mark.parametrize("run", RUNS)
def test_one_zeroing_per_stage_and_no_work_per_parameter(run: str) -> None:
    # 40 parameters per stage, 4 micro-batches: per step one zero_ of each
    # stage's buffer after zero_grad(), and no operator per parameter.
    model = mlp([6] + [6] * 20 + [4])
    _, graphed = pair(model, graphs=Silent(), chunks=4, balance=[20, 22])
    x, y = data()
    for _ in range(2):  # capture, then replay
        graphed.zero_grad()
        RUNS[run](graphed, x, y)
    graphed.zero_grad()
    with Ops() as counted:
        RUNS[run](graphed, x, y)
    assert counted.ops["zero_"] == 2  # one per stage
    per_parameter = {"clone", "detach", "add_", "copy_", "zeros_like", "add"}
    total = sum(n for name, n in counted.ops.items() if name in per_parameter)
    assert total < 40, counted.ops


class Scaled(nn.Module):
    """A float64 layer with a float32 scale: a stage of two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6).double()
        self.scale = nn.Parameter(torch.rand(6))

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) * self.scale.double()


@pytest.mark.parametrize("run", RUNS)
def test_a_stage_of_two_dtypes_is_zeroed_with_a_kernel_per_dtype(run: str) -> None:
    # Its gradient buffers are one per dtype; one list of views of both
    # would miss the multi-tensor kernel (on a GPU, a launch per parameter).
    model = nn.Sequential(Scaled(), nn.Tanh(), nn.Linear(6, 4).double())
    eager, graphed = pair(model, chunks=2, balance=[2, 1])
    x, y = data()
    for _ in range(2):  # capture, then replay
        for pipe in (eager, graphed):
            pipe.zero_grad()
            RUNS[run](pipe, x, y)
    for pipe in (eager, graphed):
        pipe.zero_grad()
    with Ops() as counted:
        RUNS[run](graphed, x, y)
    RUNS[run](eager, x, y)
    assert counted.ops["_foreach_zero_"] == 0 and counted.ops["zero_"] == 3, counted.ops
    assert_same_grads(graphed, eager)


@pytest.mark.parametrize("run", RUNS)
def test_a_stage_s_parameters_are_made_ready_once_per_pass_not_per_call(
    run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GPipe keeps 4 micro-batches in flight: 4 calls per stage, each with a
    # reached-set of its own, equal to the others'. The store checks its
    # parameters (and notes the stream) for the first only; its flush
    # looks at the stream once more. The other calls' backward tasks find
    # its answer noted (GradStore.ready): not even a call to ensure().
    eager, graphed = pair(mlp(WIDTHS), chunks=4, schedule="gpipe")
    x, y = data()
    for _ in range(2):  # capture, then replay
        RUNS[run](graphed, x, y)
    looked: list[torch.device] = []
    asked: list[object] = []

    def counted(device: torch.device) -> object:
        looked.append(device)
        return real(device)

    def ensure(store: grads_module.GradStore, *args: object) -> list[nn.Parameter]:
        asked.append(store)
        return real_ensure(store, *args)

    real, real_ensure = grads_module.current_stream, grads_module.GradStore.ensure
    monkeypatch.setattr(grads_module, "current_stream", counted)
    monkeypatch.setattr(grads_module.GradStore, "ensure", ensure)
    RUNS[run](graphed, x, y)
    assert len(looked) == 2 * 2, looked  # per stage: its first call, its flush
    assert len(asked) == len(set(map(id, asked))) == 2, asked  # per stage: its first call
    for _ in range(3):
        RUNS[run](eager, x, y)
    assert_same_grads(graphed, eager)


@pytest.mark.parametrize("how", ["foreach", "fused"])
def test_optimizers_foreach_and_fused_paths_train_equal_to_eager(how: str) -> None:
    eager, graphed = pair(mlp(WIDTHS, torch.float32), chunks=3)
    x, y = (t.float() for t in data())
    opts = [torch.optim.Adam(p.parameters(), lr=0.01, **{how: True}) for p in (eager, graphed)]
    for i in range(4):
        for pipe, opt in zip((eager, graphed), opts):
            opt.zero_grad(set_to_none=i % 2 == 0)
            if i < 2:
                pipe.train_step(x, y, nn.MSELoss())
            else:
                user_loop(pipe, x, y)
            opt.step()
    for a, b in zip(graphed.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b)


def test_a_grad_set_by_hand_is_kept_and_added_to() -> None:
    eager, graphed = pair(mlp(WIDTHS), chunks=2)
    x, y = data()
    for pipe in (eager, graphed):
        step(pipe, x, y)
    for pipe in (eager, graphed):
        for p in pipe.parameters():
            p.grad = torch.full_like(p, 0.5)  # another tensor: its value counts
        step(pipe, x, y)
    assert_same_grads(graphed, eager)


def test_a_failed_step_leaves_no_half_added_gradient() -> None:
    eager, graphed = pair(mlp(WIDTHS), chunks=4)
    x, y = data()
    calls = 0

    def failing(out: Tensor, target: Tensor) -> Tensor:
        nonlocal calls
        calls += 1
        if calls in (7, 11):  # the second step's third micro-batch; the third's
            raise RuntimeError("loss failed")
        return nn.functional.mse_loss(out, target)

    graphed.train_step(x, y, failing)
    with pytest.raises(RuntimeError, match="loss failed"):
        graphed.train_step(x, y, failing)
    eager.train_step(x, y, nn.MSELoss())
    assert_same_grads(graphed, eager)  # as after one step: the failed one left nothing
    graphed.zero_grad()  # None before a failing step: None after it
    with pytest.raises(RuntimeError, match="loss failed"):
        graphed.train_step(x, y, failing)
    assert all(p.grad is None for p in graphed.parameters())
    for pipe in (eager, graphed):
        pipe.zero_grad()
        pipe.train_step(x, y, nn.MSELoss())
    assert_same_grads(graphed, eager)


def test_a_weight_two_stages_share_is_added_once_per_stage() -> None:
    # Tied: the first and the last layer share a weight, on stages 0 and 2.
    model = mlp([5, 5, 5, 5])
    model[4].weight = model[0].weight
    eager, graphed = pair(model, chunks=3, balance=[2, 2, 2], devices=["cpu"] * 3)
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)
    for i in range(3):  # later passes add to the gradients of the first
        for pipe in (eager, graphed):
            (step if i % 2 else user_loop)(pipe, x, y)
        assert_same_grads(graphed, eager)


def fail_a_backward(pipe: Pipe, x: Tensor, y: Tensor) -> None:
    """A backward through ``pipe`` that raises once its stages' replays have
    run (in a hook on the input's gradient), then ``zero_grad``."""
    inp = x.clone().requires_grad_()
    inp.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("hook failed")))
    with pytest.raises(RuntimeError, match="hook failed"):
        nn.functional.mse_loss(pipe(inp), y).backward()
    pipe.zero_grad(set_to_none=True)


@pytest.mark.parametrize("then", ["backward", "train_step"])
def test_after_a_failed_backward_the_next_pass_starts_clean(then: str) -> None:
    eager, graphed = pair(mlp(WIDTHS), chunks=4)
    x, y = data()
    for pipe in (eager, graphed):
        fail_a_backward(pipe, x, y)
        if then == "train_step":
            pipe.train_step(x, y, nn.MSELoss())
        else:
            nn.functional.mse_loss(pipe(x), y).backward()
    assert_same_grads(graphed, eager)


def test_a_backward_inside_a_backward() -> None:
    eager, graphed = pair(mlp(WIDTHS), chunks=2)
    x, y = data()
    x2, y2 = data()
    for pipe in (eager, graphed):

        class Nested(torch.autograd.Function):
            """Runs another backward through the same pipe from its own."""

            @staticmethod
            def forward(ctx: object, t: Tensor) -> Tensor:  # type: ignore[override]
                return t.clone()

            @staticmethod
            def backward(ctx: object, g: Tensor) -> Tensor:  # type: ignore[override]
                with torch.enable_grad():
                    nn.functional.mse_loss(pipe(x2), y2).backward()  # noqa: B023
                return g

        out = pipe(Nested.apply(x.clone().requires_grad_()))
        nn.functional.mse_loss(out, y).backward()
    assert_same_grads(graphed, eager)


class Branch(nn.Module):
    """Block 0's value reaches stage 1, which drops it with block 1's."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        self.blocks[1](self.blocks[0](x))
        return self.blocks[2](x)  # type: ignore[no-any-return]


def check_reached(model: nn.Module, split: str, schedule: str, reached: list[str]) -> None:
    """After a backward and a ``train_step``, eager and graphed pipes give
    gradients to ``reached`` only, and equal ones."""
    eager, graphed = pair(
        model.double(), chunks=2, schedule=schedule, balance=None, split_points=[split]
    )
    x, y = torch.randn(4, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    for pipe in (eager, graphed):
        pipe(x).sum().backward()
        pipe.train_step(x, y, nn.MSELoss())
    for pipe in (eager, graphed):
        assert [n for n, p in pipe.named_parameters() if p.grad is not None] == reached
    for name in reached:
        torch.testing.assert_close(graphed.get_parameter(name).grad, eager.get_parameter(name).grad)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_a_call_no_gradient_reaches_leaves_its_parameters_without_one(schedule: str) -> None:
    # A replayed backward would hand them zeros where eager autograd gives None.
    check_reached(Branch(), "blocks.1", schedule, ["blocks.2.weight", "blocks.2.bias"])


class TwoOut(nn.Module):
    """Stage 0 returns blocks 0's and 1's values; stage 1 drops block 0's."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.blocks[0](x), self.blocks[1](x)
        self.blocks[2](a)
        return self.blocks[3](b)  # type: ignore[no-any-return]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_what_only_an_output_without_gradient_reaches_gets_none(schedule: str) -> None:
    reached = ["blocks.1.weight", "blocks.1.bias", "blocks.3.weight", "blocks.3.bias"]
    check_reached(TwoOut(), "blocks.2", schedule, reached)


def test_a_plain_ddp_around_a_graphed_pipe_is_refused_with_what_to_do() -> None:
    # Its reducer hooks on each parameter's AccumulateGrad, which never runs.
    from mpstream.runtime.graphed import stages

    _, graphed = pair(mlp(WIDTHS), chunks=2)
    x, y = data()
    real = stages._inside_ddp
    try:
        stages._inside_ddp = lambda: True  # type: ignore[assignment]
        with pytest.raises(RuntimeError, match="mpstream.distributed.train_step"):
            graphed(x)
        with torch.no_grad():
            graphed(x)  # inference under DDP: nothing for the reducer
    finally:
        stages._inside_ddp = real  # type: ignore[assignment]
    user_loop(graphed, x, y)  # the next call works


def test_the_graphs_of_a_changed_stage_hand_over_its_gradients() -> None:
    # Replacing a parameter recaptures; the gradients stay what they were.
    eager, graphed = pair(mlp(WIDTHS), chunks=2)
    x, y = data()
    for pipe in (eager, graphed):
        step(pipe, x, y)
    for pipe in (eager, graphed):
        first = pipe.partitions[0][0]
        weight = nn.Parameter(first.weight.detach().clone())
        weight.grad = first.weight.grad.clone()  # type: ignore[union-attr]
        first.weight = weight
        step(pipe, x, y)
    assert_same_grads(graphed, eager)


def test_emulated_capture_adds_nothing() -> None:
    # Capture (warm-up, the captured run) must not add into .grad.
    stage = mlp([4, 4])
    reference = copy.deepcopy(stage)
    pipe = Pipe(stage, balance=[2], devices=["cpu"], graphs=Emulated(), chunks=1)
    x = torch.randn(3, 4, dtype=torch.float64)
    pipe.train_step(x, x, nn.MSELoss())
    nn.functional.mse_loss(reference(x), x).backward()
    assert_same_grads(pipe, reference)


def tied_model() -> nn.Sequential:
    """The first and the last layer share a weight (stages 0 and 2 of three)."""
    model = mlp([5, 5, 5, 5])
    model[4].weight = model[0].weight
    return model


def test_a_failed_backward_adds_nothing_of_a_tied_weight_later() -> None:
    # autograd runs no final callback after a failure, so the side buffer of
    # the failed pass was left to be added into the next pass's .grad.
    eager, graphed = pair(tied_model(), chunks=3, balance=[2, 2, 2], devices=["cpu"] * 3)
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)
    for pipe in (eager, graphed):
        user_loop(pipe, x, y)  # captures
        pipe.zero_grad(set_to_none=True)
        fail_a_backward(pipe, x, y)
        user_loop(pipe, x, y)
    assert_same_grads(graphed, eager)

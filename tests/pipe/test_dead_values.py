"""Values a stage hands on that no loss reaches (a later stage reads them into
a result it drops): with copies between stages, the pipe's backward reaches
exactly the nodes the plain model's does (under ``mpstream.profile`` too), so
it calls the same tensor hooks, never one with None, and leaves the same
``.grad`` unset; forward values and every gradient match the plain model."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from mpstream import Pipe, profile
from mpstream.runtime.graphed import Emulated
from mpstream.runtime.plan import Plan, verify_plan

BATCH = 4


def lin() -> nn.Linear:
    return nn.Linear(2, 2, dtype=torch.float64)


class DeadNext(nn.Module):
    """Stage 0 makes ``d``; stage 1 reads it into a value it drops."""

    def __init__(self) -> None:
        super().__init__()
        self.dead, self.live, self.unused, self.out = lin(), lin(), lin(), lin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.dead(x)
        h = self.live(x)
        self.unused(d)
        return self.out(h)


class DeadPastNext(nn.Module):
    """Stage 0 makes ``d`` and ``s``; stage 2 (past the next) reads both, ``d``
    into a value it drops: one hop carries them."""

    def __init__(self) -> None:
        super().__init__()
        self.dead, self.skip, self.live, self.mid = lin(), lin(), lin(), lin()
        self.unused, self.out = lin(), lin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.dead(x)
        s = self.skip(x)
        h = self.mid(self.live(x))
        self.unused(d)
        return self.out(h) + s


class DeadFromInput(nn.Module):
    """``d`` requires grad only through the input: no parameter makes it."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.unused, self.out = lin(), lin(), lin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x * 2
        h = self.live(x.detach())
        self.unused(d)
        return self.out(h)


class MakeDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dead, self.live = lin(), lin()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"dead": self.dead(x), "live": self.live(x)}


class ReadDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused, self.out = lin(), lin()

    def forward(self, v: dict[str, torch.Tensor]) -> torch.Tensor:
        self.unused(v["dead"])
        return self.out(v["live"])


class MakeTuple(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dead, self.live = lin(), lin()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.live(x), self.dead(x)


class ReadTuple(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused, self.out = lin(), lin()

    def forward(self, v: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        live, dead = v
        self.unused(dead)
        return self.out(live)


# Per case: the model, and how the pipe splits it.
CASES: dict[str, tuple[Callable[[], nn.Module], dict[str, Any]]] = {
    "next": (DeadNext, {"split_points": ["unused"]}),
    "past_next": (DeadPastNext, {"split_points": ["mid", "unused"]}),
    "from_input": (DeadFromInput, {"split_points": ["unused"]}),
    "dict": (lambda: nn.Sequential(MakeDict(), ReadDict()), {"balance": [1, 1]}),
    "tuple": (lambda: nn.Sequential(MakeTuple(), ReadTuple()), {"balance": [1, 1]}),
}


def watch(module: nn.Module, x: torch.Tensor | None = None) -> dict[str, list[bool]]:
    """Per parameter (and the input ``x``, if given), each call of a tensor
    hook on it: whether the hook got None. The hooks change nothing."""
    calls: dict[str, list[bool]] = {}

    def hook(name: str) -> Callable[[torch.Tensor | None], None]:
        calls[name] = []
        return lambda g: calls[name].append(g is None)

    for name, p in module.named_parameters():
        p.register_hook(hook(name))
    if x is not None:
        x.register_hook(hook("input"))
    return calls


def pipe_of(name: str, **kwargs: Any) -> tuple[nn.Module, Pipe]:
    make, split = CASES[name]
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    stages = len(split.get("balance", [])) or len(split["split_points"]) + 1
    pipe = Pipe(model, devices=["cpu"] * stages, force_copies=True, **split, **kwargs)
    return ref, pipe


def grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_the_users_loop_calls_the_hooks_the_plain_model_calls(
    case: str, chunks: int, checkpoint: str
) -> None:
    ref, pipe = pipe_of(case, chunks=chunks, checkpoint=checkpoint)
    x = torch.randn(BATCH, 2, dtype=torch.float64)
    x_ref, x_pipe = x.clone().requires_grad_(), x.clone().requires_grad_()
    seen_ref, seen_pipe = watch(ref, x_ref), watch(pipe, x_pipe)
    out_ref, out_pipe = ref(x_ref), pipe(x_pipe)
    torch.testing.assert_close(out_pipe, out_ref)
    out_ref.pow(2).sum().backward()
    out_pipe.pow(2).sum().backward()
    assert seen_pipe == seen_ref
    assert not any(none for calls in seen_ref.values() for none in calls)
    assert seen_ref["input"] == ([False] if case != "from_input" else [])
    torch.testing.assert_close(grads(pipe), grads(ref))
    torch.testing.assert_close(x_pipe.grad, x_ref.grad)


class ReadBoth(nn.Module):
    """Returns an output of each value: a loss may leave one out."""

    def __init__(self) -> None:
        super().__init__()
        self.other, self.out = lin(), lin()

    def forward(self, v: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        live, dead = v
        return self.out(live), self.other(dead)


@pytest.mark.filterwarnings("ignore:.*has a tensor hook:mpstream.runtime.graphed.GraphWarning")
def test_a_graphed_stage_s_output_a_loss_leaves_out_calls_the_eager_hooks_behind_it_with_none() -> (
    None
):
    # The documented difference (docs/tuning.md, graphed stages): a replay
    # is one autograd node, reached through the output the loss uses, so
    # autograd walks the eager stage that made the value only the left-out
    # output reads, with no gradient.
    torch.manual_seed(0)
    model = nn.Sequential(MakeTuple(), ReadBoth())
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[1, 1], devices=["cpu"] * 2, graphs=Emulated())
    seen_ref, seen_pipe = watch(ref[0]), watch(pipe.partitions[0])  # stage 1 stays graphed
    x = torch.randn(BATCH, 2, dtype=torch.float64)
    ref(x)[0].pow(2).sum().backward()
    pipe(x)[0].pow(2).sum().backward()
    assert seen_ref == {
        "dead.weight": [], "dead.bias": [], "live.weight": [False], "live.bias": [False],
    }  # fmt: skip
    assert seen_pipe == {
        "0.dead.weight": [True], "0.dead.bias": [True], "0.live.weight": [False],
        "0.live.bias": [False],
    }  # fmt: skip
    rows = str(pipe.graph_report()).splitlines()
    assert [rows[1].split()[2], rows[2].split()[2]] == ["no", "yes"]  # 0 eager by its hooks
    torch.testing.assert_close(grads(pipe), grads(ref))


class ReadTwo(nn.Module):
    """Two inputs, an output of each: a loss may leave one out."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(y)


def test_a_graphed_stage_s_left_out_output_calls_the_hooks_of_the_input_it_reads_with_none() -> (
    None
):
    # The same difference for a pipe input (the user's own tensor stands
    # where the eager stage does above): only the left-out output reads
    # ``y``, which the plain model's backward never reaches.
    torch.manual_seed(0)
    model = ReadTwo()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, split_points=[], devices=["cpu"], graphs=Emulated())
    x = torch.randn(BATCH, 2, dtype=torch.float64)
    y = torch.randn(BATCH, 2, dtype=torch.float64)
    y_ref, y_pipe = y.clone().requires_grad_(), y.clone().requires_grad_()
    # Hooks on the input only: one on a parameter would make the stage eager.
    seen_ref, seen_pipe = watch(nn.Module(), y_ref), watch(nn.Module(), y_pipe)
    ref(x, y_ref)[0].pow(2).sum().backward()
    pipe(x, y_pipe)[0].pow(2).sum().backward()
    assert seen_ref == {"input": []}
    assert seen_pipe == {"input": [True]}
    assert y_pipe.grad is None and y_ref.grad is None
    torch.testing.assert_close(grads(pipe), grads(ref))


def test_only_the_tensors_a_gradient_reaches_open_a_gradient_copy() -> None:
    # One gradient copy per hop and micro-batch in the plan, as before: the
    # dead tensor's node never runs, and the plan stays valid.
    ref, pipe = pipe_of("next", chunks=2)
    pipe.scheduler.recording = True
    pipe(torch.randn(BATCH, 2, dtype=torch.float64)).sum().backward()
    sched = pipe.scheduler
    plan = Plan(sched.plan(), sched.slot_names, sched.slot_devices, 2)
    verify_plan(plan)
    runs = [(op.stage, op.micro) for op in plan.ops if op.kind == "copy_grad" and op.op == "run"]
    assert sorted(runs) == [(0, 0), (0, 1)]


@pytest.mark.parametrize(
    ("schedule", "case", "virtual"),
    [
        ("gpipe", "past_next", None),
        ("1f1b", "past_next", None),
        ("zb_h1", "past_next", None),
        ("interleaved_1f1b", "next", 2),
        ("interleaved_1f1b", "dict", 2),
    ],
)
def test_a_training_step_never_calls_a_hook_with_none(
    schedule: str, case: str, virtual: int | None
) -> None:
    ref, pipe = pipe_of(case, chunks=3, schedule=schedule, virtual_stages=virtual)
    x, y = (torch.randn(BATCH, 2, dtype=torch.float64) for _ in range(2))
    seen = watch(pipe)
    pipe.train_step(x, y, nn.MSELoss())
    nn.MSELoss()(ref(x), y).backward()
    assert not any(none for calls in seen.values() for none in calls)
    assert {n for n, calls in seen.items() if calls} == {
        n for n, g in grads(ref).items() if g is not None
    }
    torch.testing.assert_close(grads(pipe), grads(ref))


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_profiled_loop_calls_the_hooks_the_plain_model_calls(case: str, checkpoint: str) -> None:
    # The timing marks around each stage's backward take a tensor each, as
    # the copies do: a value no loss reaches runs no backward there either.
    ref, pipe = pipe_of(case, chunks=2, checkpoint=checkpoint)
    x = torch.randn(BATCH, 2, dtype=torch.float64)
    x_ref, x_pipe = x.clone().requires_grad_(), x.clone().requires_grad_()
    seen_ref, seen_pipe = watch(ref, x_ref), watch(pipe, x_pipe)
    with profile(pipe) as prof:
        out_pipe = pipe(x_pipe)
        out_pipe.pow(2).sum().backward()
    out_ref = ref(x_ref)
    out_ref.pow(2).sum().backward()
    torch.testing.assert_close(out_pipe, out_ref)
    assert seen_pipe == seen_ref
    torch.testing.assert_close(grads(pipe), grads(ref))
    torch.testing.assert_close(x_pipe.grad, x_ref.grad)
    # Each stage's backward is timed per micro-batch, but one that reaches
    # none of the stage's inputs: from_input's first stage (only what it
    # detached from the input is live) has nowhere to end.
    timed = Counter(s.stage for s in prof.spans if s.kind == "backward")
    stages = len(pipe.devices)
    assert timed == {s: 2 for s in range(case == "from_input", stages)}

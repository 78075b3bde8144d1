"""Random sessions for :mod:`tests.pipe.test_random_sessions`: how a Pipe
is built (a :class:`Session`) and the calls a training loop makes of it
(:class:`Call`), drawn by hypothesis, and the Pipe a session builds.

Besides stages, split, schedule and checkpointing, a session draws the
tracer (``torch.fx``, or rarely ``torch.export`` as it is slow), deferred
BatchNorm, an explicit order in place of a built-in schedule (its
``train_step`` calls then take batches of the order's micro-batch count,
but for a rare one of another count, which the pipe refuses), and an
autocast dtype the calls run under.
"""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis", reason="a property test: needs hypothesis (the dev extra)")

import random
from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor, nn

import mpstream
from mpstream import Pipe
from mpstream.memory.checkpoint import MODES
from mpstream.observe.profiling import Profile
from mpstream.runtime.graphed import Emulated
from mpstream.schedules import PLACEMENTS
from tests.random_models import Recipe, micro_batches, recipes, split_args

__all__ = [
    "Call",
    "Session",
    "sessions",
    "make_pipe",
    "micros",
    "virtual_for",
    "strict_hook",
    "check_profile",
]


@dataclass(frozen=True)
class Call:
    """One call of the session."""

    kind: str  # "no_grad", "backward" (a user loop's), "grad" (torch.autograd.grad) or "train_step"
    batch: int
    training: bool
    input_grad: bool
    zero_grad: bool  # gradients set to None before it (else they accumulate)
    hooks: int  # strict gradient hooks registered before it, on parameters spread over blocks
    toggle: int | None  # a block whose parameters' requires_grad flips before it
    sgd: bool  # an SGD step after it
    profiled: bool  # runs inside ``with mpstream.profile(pipe)``
    io_hooks: bool  # strict hooks on the inputs and the pipe's outputs ("backward", "grad")
    retain: bool  # "backward": twice, the first with retain_graph=True
    ignore: bool  # the loss ignores the first output leaf (of several): a dead value


@dataclass(frozen=True)
class Session:
    """How the Pipe is built, and the calls made of it."""

    stages: int
    sequential: bool
    tracer: str  # for split_points: "fx" or "export"
    cuts: tuple[int, ...]
    chunks: int | None
    split_size: int | None
    schedule: str  # a built-in's name, or "order": a random explicit order (order_rng)
    order_rng: random.Random | None
    virtual_stages: int | None
    checkpoint: str
    force_copies: bool
    graphs: bool
    deferred: bool
    dtype: torch.dtype
    autocast: torch.dtype | None  # every call runs under torch.autocast("cpu", dtype=...)
    frozen: tuple[int, ...]  # blocks whose parameters are frozen
    calls: tuple[Call, ...]
    seed: int


def virtual_for(schedule: str, stages: int) -> tuple[int | None, ...]:
    """The virtual_stages a schedule takes with ``stages`` stages, all on the CPU."""
    if schedule == "order":
        return (None,)
    placement = PLACEMENTS.get(schedule, "stage")
    if placement == "v":  # two stages per rank
        return (2,) if stages % 2 == 0 else ()
    if stages == 1 or placement == "stage":
        return (None,)
    return tuple(v for v in range(2, stages + 1) if stages % v == 0)


def micros(batch: int, s: Session) -> int:
    """How many micro-batches the session's pipe makes of ``batch`` samples."""
    return len(micro_batches(torch.empty(batch), (s.chunks, s.split_size)))


@st.composite
def sessions(draw: st.DrawFn) -> tuple[Recipe, Session]:
    recipe = draw(recipes())
    n = len(recipe.steps)
    stages = min(n, draw(st.sampled_from([2, 3, 4, 6, 1])))
    cuts = tuple(sorted(draw(st.sets(st.integers(1, n - 1), min_size=stages - 1,
                                     max_size=stages - 1)))) if stages > 1 else ()  # fmt: skip
    schedules = [s for s in [*mpstream.SCHEDULES, "order"] if virtual_for(s, stages)]
    schedule = draw(st.sampled_from(schedules))
    how, size = draw(st.sampled_from(["chunks", "split_size", None])), draw(st.integers(1, 6))
    call = st.builds(
        Call,
        kind=st.sampled_from(["backward", "train_step", "no_grad", "backward", "grad"]),
        batch=st.integers(2, 9),
        training=st.sampled_from([True, True, False]),
        input_grad=st.booleans(),
        zero_grad=st.booleans(),
        hooks=st.sampled_from([0, 0, 1, 3]),
        toggle=st.none() | st.none() | st.integers(0, n - 1),
        sgd=st.booleans(),
        profiled=st.sampled_from([False, False, True]),
        io_hooks=st.sampled_from([False, True]),
        retain=st.sampled_from([False, False, True]),
        ignore=st.sampled_from([False, False, True]),
    )
    sequential = recipe.is_chain and draw(st.booleans())
    dtype = draw(st.sampled_from([torch.float64] * 3 + [torch.float32] * 3
                                 + [torch.bfloat16, torch.float16]))  # fmt: skip
    session = Session(
        stages=stages,
        sequential=sequential,
        tracer="fx" if sequential else draw(st.sampled_from(["fx"] * 11 + ["export"])),
        cuts=cuts,
        chunks=size if how == "chunks" else None,
        split_size=size if how == "split_size" else None,
        schedule=schedule,
        order_rng=draw(st.randoms()) if schedule == "order" else None,
        virtual_stages=draw(st.sampled_from(virtual_for(schedule, stages))),
        checkpoint=draw(st.sampled_from(MODES)),
        force_copies=draw(st.booleans()),
        graphs=draw(st.sampled_from([True, True, False])),
        deferred=recipe.has_norm and draw(st.booleans()),
        dtype=dtype,
        # Autocast casts float32 (not float64) and meets 16-bit BatchNorm
        # weights with its own dtype, which torch refuses: float32 models.
        autocast=draw(st.sampled_from([None, torch.bfloat16, torch.float16]))
        if dtype == torch.float32
        else None,
        frozen=tuple(sorted(draw(st.sets(st.integers(0, n - 1), max_size=max(1, n - 1))))),
        calls=tuple(draw(st.lists(call, min_size=2, max_size=4))),
        seed=draw(st.integers(0, 2**16)),
    )
    if schedule == "order":
        # An order fixes the micro-batch count of a train_step: the session's
        # take batches of the first one's count, but for a rare other one.
        steps = [c for c in session.calls if c.kind == "train_step"]
        count = micros(steps[0].batch, session) if steps else 1
        fits = [b for b in range(2, 10) if micros(b, session) == count]
        calls = tuple(
            c
            if c.kind != "train_step" or not draw(st.integers(0, 7))
            else replace(c, batch=draw(st.sampled_from(fits)))
            for c in session.calls
        )
        session = replace(session, calls=calls)
    return recipe, session


def make_pipe(model: nn.Module, s: Session, recipe: Recipe, order: str | None = None) -> Pipe:
    """The session's Pipe of ``model``, running ``order`` when given (else
    the session's built-in schedule, or gpipe for an order yet to draw)."""
    kw = split_args(model, recipe, s.cuts, sequential=s.sequential, tracer=s.tracer, dtype=s.dtype)
    schedule = order if order is not None else s.schedule
    return Pipe(
        model,
        chunks=s.chunks,
        split_size=s.split_size,
        devices=["cpu"] * s.stages,
        schedule="gpipe" if schedule == "order" else schedule,
        virtual_stages=s.virtual_stages,
        checkpoint=s.checkpoint,
        force_copies=s.force_copies,
        graphs=Emulated() if s.graphs else False,
        deferred_batch_norm=s.deferred,
        **kw,
    )


def strict_hook(factor: float | None, what: str, none: bool = False) -> Any:
    """A tensor hook that fails if called with None (the pipe calls hooks
    only where the plain model does, which never passes None), scaling the
    gradient by ``factor`` (None: only looks). ``none``: a call with None is
    expected and returns at once (docs/tuning.md: an eager stage's value
    that a graphed stage reads and no loss reaches)."""

    def hook(grad: Tensor | None) -> Tensor | None:
        if grad is None and none:
            return None
        assert grad is not None, f"{what}: a tensor hook called with None"
        return None if factor is None else grad * factor

    return hook


def check_profile(
    prof: Profile, s: Session, kind: str, passes: int, backward: bool, what: str
) -> None:
    """A profiled call's timeline: it reads (summary, chrome trace), its
    spans are of the pipe's stages and last no negative time, and every
    stage forwarded (none of a refused ``train_step``: a call that raises
    leaves no spans); a call whose loss reached a backward has backward spans
    in ``train_step`` (the scheduler times it) and at most one per stage,
    micro-batch and backward pass (``passes``) in a user loop (autograd's
    marks)."""
    if kind == "train_step" and not backward:  # refused: a call that raises leaves no spans
        assert not prof.spans, f"{what}: spans of a refused call: {prof.spans}"
        return
    prof.summary(echo=False)
    prof.chrome_trace()
    for span in prof.spans:
        assert span.end_ms >= span.start_ms, f"{what}: {span} ends before it starts"
        assert -1 <= span.stage < s.stages, f"{what}: {span} of no stage"
    forwards = {span.stage for span in prof.spans if span.kind == "forward"}
    assert forwards == set(range(s.stages)), f"{what}: forward spans of stages {forwards}"
    backs = [(span.stage, span.micro) for span in prof.spans if span.kind == "backward"]
    if kind == "train_step" and backward:
        assert backs, f"{what}: a train_step with no backward span"
    elif kind in ("backward", "grad"):
        assert all(backs.count(b) <= passes for b in backs), f"{what}: backward spans {backs}"

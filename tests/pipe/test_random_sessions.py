"""Property: over a session of calls, as a training loop makes them, a Pipe
keeps computing what the plain model computes.

Where :mod:`tests.pipe.test_random_models` checks one configuration on a
fixed sequence of calls, this draws the sequence: two to four calls, each
with its own batch size, train or eval mode, inputs that require grad or
not, and kind (``no_grad``; a user loop's ``loss_fn(pipe(x), y).backward()``;
``train_step``), gradients zeroed before it or accumulated, a tensor hook
registered on a parameter or a block frozen or unfrozen before it, an SGD
step after it. The pipe has
some blocks frozen (``requires_grad=False``), runs in float64, float32 or
bfloat16, on 1-6 stages (up to six stages on one rank for the interleaved
schedules), with emulated CUDA graphs often, as graphed stages re-key on
batch size, mode and ``requires_grad``.

The plain model runs in the same dtype; float32 and bfloat16 are compared
within :data:`TOLERANCE` (a micro-batch's matmuls sum in another order, and
gradients accumulate over micro-batches in the dtype itself).
"""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis", reason="a property test: needs hypothesis (the dev extra)")

import copy
import os
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils import _pytree as pytree

import mpstream
from mpstream import NoChunk, Pipe
from mpstream.memory.checkpoint import MODES
from mpstream.runtime.graphed import Emulated
from mpstream.schedules import PLACEMENTS
from tests.random_models import Recipe, Reference, build, leaves, micro_batches, recipes

#: (rtol, atol) per dtype; float64 is torch's default.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-3, 1e-4),  # BatchNorm of two samples amplifies reordered sums
    torch.bfloat16: (5e-2, 5e-2),
}


@dataclass(frozen=True)
class Call:
    """One call of the session."""

    kind: str  # "no_grad", "backward" (a user loop's) or "train_step"
    batch: int
    training: bool
    input_grad: bool
    zero_grad: bool  # gradients set to None before it (else they accumulate)
    hook: bool  # a gradient hook registered on a parameter before it
    toggle: int | None  # a block whose parameters' requires_grad flips before it
    sgd: bool  # an SGD step after it


@dataclass(frozen=True)
class Session:
    """How the Pipe is built, and the calls made of it."""

    stages: int
    sequential: bool
    cuts: tuple[int, ...]
    chunks: int | None
    split_size: int | None
    schedule: str
    virtual_stages: int | None
    checkpoint: str
    force_copies: bool
    graphs: bool
    dtype: torch.dtype
    frozen: tuple[int, ...]  # blocks whose parameters are frozen
    calls: tuple[Call, ...]
    seed: int


def virtual_for(schedule: str, stages: int) -> tuple[int | None, ...]:
    """The virtual_stages a schedule takes with ``stages`` stages, all on the CPU."""
    placement = PLACEMENTS.get(schedule, "stage")
    if placement == "v":  # two stages per rank
        return (2,) if stages % 2 == 0 else ()
    if stages == 1 or placement == "stage":
        return (None,)
    return tuple(v for v in range(2, stages + 1) if stages % v == 0)


@st.composite
def sessions(draw: st.DrawFn) -> tuple[Recipe, Session]:
    recipe = draw(recipes())
    n = len(recipe.steps)
    stages = min(n, draw(st.sampled_from([2, 3, 4, 6, 1])))
    cuts = tuple(sorted(draw(st.sets(st.integers(1, n - 1), min_size=stages - 1,
                                     max_size=stages - 1)))) if stages > 1 else ()  # fmt: skip
    schedules = [s for s in mpstream.SCHEDULES if virtual_for(s, stages)]
    schedule = draw(st.sampled_from(schedules))
    how, size = draw(st.sampled_from(["chunks", "split_size", None])), draw(st.integers(1, 6))
    call = st.builds(
        Call,
        kind=st.sampled_from(["backward", "train_step", "no_grad"]),
        batch=st.integers(2, 9),
        training=st.sampled_from([True, True, False]),
        input_grad=st.booleans(),
        zero_grad=st.booleans(),
        hook=st.sampled_from([False, False, True]),
        toggle=st.none() | st.none() | st.integers(0, n - 1),
        sgd=st.booleans(),
    )
    session = Session(
        stages=stages,
        sequential=recipe.is_chain and draw(st.booleans()),
        cuts=cuts,
        chunks=size if how == "chunks" else None,
        split_size=size if how == "split_size" else None,
        schedule=schedule,
        virtual_stages=draw(st.sampled_from(virtual_for(schedule, stages))),
        checkpoint=draw(st.sampled_from(MODES)),
        force_copies=draw(st.booleans()),
        graphs=draw(st.sampled_from([True, True, False])),
        dtype=draw(st.sampled_from([torch.float64, torch.float64, torch.float32, torch.bfloat16])),
        frozen=tuple(sorted(draw(st.sets(st.integers(0, n - 1), max_size=max(1, n - 1))))),
        calls=tuple(draw(st.lists(call, min_size=2, max_size=4))),
        seed=draw(st.integers(0, 2**16)),
    )
    return recipe, session


def make_pipe(model: nn.Module, s: Session) -> Pipe:
    kw: dict[str, Any] = {}
    if s.sequential:
        bounds = [0, *s.cuts, len(model)]  # type: ignore[arg-type]
        kw["balance"] = [b - a for a, b in zip(bounds, bounds[1:])]
    else:
        kw["split_points"] = [f"blocks.{k}" for k in s.cuts]
    return Pipe(
        model,
        chunks=s.chunks,
        split_size=s.split_size,
        devices=["cpu"] * s.stages,
        schedule=s.schedule,
        virtual_stages=s.virtual_stages,
        checkpoint=s.checkpoint,
        force_copies=s.force_copies,
        graphs=Emulated() if s.graphs else False,
        **kw,
    )


class Compare:
    """Comparisons within the session's dtype's tolerance."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.rtol, self.atol = TOLERANCE[dtype]

    def close(self, a: Tensor, b: Tensor, what: str) -> None:
        torch.testing.assert_close(
            a, b, rtol=self.rtol, atol=self.atol, msg=lambda m: f"{what}: {m}"
        )

    def same(self, a: Any, b: Any, what: str) -> None:
        assert pytree.tree_structure(a) == pytree.tree_structure(b), what
        for x, y in zip(leaves(a), leaves(b)):
            self.close(x, y, what)

    def grad(self, got: Tensor | None, want: Tensor | None, what: str) -> None:
        assert (got is None) == (want is None), f"{what}: {got} vs {want}"
        if got is not None and want is not None:
            self.close(got, want, what)

    def state(self, pipe: nn.Module, ref: nn.Module, what: str) -> None:
        """Parameters, their gradients, and buffers (BatchNorm statistics)."""
        got, want = dict(pipe.named_parameters()), dict(ref.named_parameters())
        assert got.keys() == want.keys()
        for name, p in want.items():
            assert got[name].requires_grad == p.requires_grad, f"{what}: {name}"
            self.close(got[name], p, f"{what}: {name}")
            self.grad(got[name].grad, p.grad, f"{what}: gradient of {name}")
        buffers = dict(pipe.named_buffers())
        for name, b in ref.named_buffers():
            self.close(buffers[name], b, f"{what}: {name}")


def check(recipe: Recipe, s: Session) -> None:
    torch.manual_seed(s.seed)
    model = build(recipe, s.sequential).to(s.dtype)
    blocks = model if s.sequential else model.blocks  # type: ignore[union-attr]
    for k in s.frozen:
        blocks[k].requires_grad_(False)  # type: ignore[index]
    ref = copy.deepcopy(model)
    pipe = make_pipe(model, s)
    cmp = Compare(s.dtype)
    split = (s.chunks, s.split_size)
    trainable = [name for name, p in ref.named_parameters() if p.requires_grad]
    event("frozen", "all" if not trainable else "some" if s.frozen else "none")
    event("dtype", str(s.dtype))
    event("graphs", str(s.graphs))
    scale = None
    if recipe.gain is not None:
        scale = torch.rand(recipe.gain_width(), dtype=s.dtype) + 0.5

    for i, c in enumerate(s.calls):
        what = f"call {i} ({c.kind})"
        smallest = min(len(m) for m in micro_batches(torch.empty(c.batch), split))
        # BatchNorm of one sample in training: the plain model refuses it.
        training = c.training and not (recipe.has_norm and smallest == 1)
        pipe.train(training)
        ref.train(training)
        if c.zero_grad:
            pipe.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
        if c.toggle is not None:
            prefix = f"{c.toggle}." if s.sequential else f"blocks.{c.toggle}."
            for name, p in ref.named_parameters():
                if name.startswith(prefix):
                    p.requires_grad_(not p.requires_grad)
                    pipe.get_parameter(name).requires_grad_(p.requires_grad)
        trainable = [name for name, p in ref.named_parameters() if p.requires_grad]
        if c.hook and trainable:
            name = trainable[i % len(trainable)]
            factor = float(i + 2)
            for module in (pipe, ref):
                module.get_parameter(name).register_hook(lambda g, f=factor: g * f)
        plain = Reference(ref, recipe.has_norm and training, split, deferred=False)
        inputs = tuple(torch.randn(c.batch, w, dtype=s.dtype) for w in recipe.inputs)
        xs = tuple(t.clone().requires_grad_(c.input_grad) for t in inputs)
        rs = tuple(t.clone().requires_grad_(c.input_grad) for t in inputs)
        kw_pipe = {} if scale is None else {"scale": NoChunk(scale), "alpha": 0.5}
        kw_ref = {} if scale is None else {"scale": scale, "alpha": 0.5}

        def loss_fn(out: Any, target: Any) -> Tensor:
            pairs = zip(leaves(out), leaves(target))
            return sum(nn.functional.mse_loss(o, t) for o, t in pairs)  # type: ignore[return-value]

        if c.kind == "no_grad":
            with torch.no_grad():
                cmp.same(pipe(*xs, **kw_pipe), plain(*rs, **kw_ref), what)
        elif c.kind == "backward":
            out, expected = pipe(*xs, **kw_pipe), plain(*rs, **kw_ref)
            cmp.same(out, expected, what)
            target = pytree.tree_map(torch.randn_like, expected)
            loss, want = loss_fn(out, target), loss_fn(expected, target)
            cmp.close(loss, want, f"{what}: loss")
            if want.requires_grad:
                loss.backward()  # type: ignore[no-untyped-call]
                want.backward()  # type: ignore[no-untyped-call]
            for x, r in zip(xs, rs):
                cmp.grad(x.grad, r.grad, f"{what}: input gradient")
        else:
            statistics = {n: b.clone() for n, b in ref.named_buffers()}
            expected = plain(*inputs, **kw_ref)
            target = pytree.tree_map(lambda e: torch.randn_like(e.detach()), expected)
            args: Any = inputs if len(inputs) > 1 else inputs[0]
            if scale is not None:
                args = (*inputs, NoChunk(scale), 0.5)
            want = loss_fn(expected, target)
            try:
                loss = pipe.train_step(args, target, loss_fn)
            except RuntimeError as e:
                # Every parameter the loss reads is frozen: refused, as the
                # plain backward is, the statistics its forwards wrote put back.
                assert not want.requires_grad and "does not require grad" in str(e), e
                for name, b in ref.named_buffers():
                    b.copy_(statistics[name])
                cmp.state(pipe, ref, f"{what}: refused")
                continue
            assert want.requires_grad, f"{what}: a loss that needs no gradient, not refused"
            want.backward()  # type: ignore[no-untyped-call]
            cmp.close(loss, want.detach(), f"{what}: loss")
        cmp.state(pipe, ref, what)
        if c.sgd:
            torch.optim.SGD(pipe.parameters(), lr=0.1).step()
            torch.optim.SGD(ref.parameters(), lr=0.1).step()
            cmp.state(pipe, ref, f"{what}: after SGD")
        note(f"{what} passed")


EXAMPLES = int(os.environ.get("MPSTREAM_PROPERTY_EXAMPLES", "0"))  # see test_random_models


@settings(
    derandomize=not EXAMPLES,
    max_examples=EXAMPLES or 25,  # ~10% of test_random_models' time
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(sessions())
@pytest.mark.filterwarnings("ignore:.*has a tensor hook:mpstream.runtime.graphed.GraphWarning")
def test_a_session_of_calls_equals_the_plain_model(case: tuple[Recipe, Session]) -> None:
    check(*case)

"""Property: over a session of calls, as a training loop makes them, a Pipe
keeps computing what the plain model computes.

Where :mod:`tests.pipe.test_random_models` checks one configuration on a
fixed sequence of calls, this draws the sequence: two to four calls, each
with its own batch size, train or eval mode, inputs that require grad or
not, and kind (``no_grad``; a user loop's ``loss_fn(pipe(x), y).backward()``,
sometimes twice, the first with ``retain_graph=True``; the same loss's
``torch.autograd.grad`` of some parameters and the inputs; ``train_step``),
gradients zeroed before it or accumulated, strict tensor hooks (failing if
called with None) registered on parameters of several blocks, on the inputs
and on the pipe's outputs, or a block frozen or unfrozen before it, an SGD
step after it, and a loss that may ignore the first of several output
leaves (what only it reads is a dead value, as is a block's output no later
block reads). Some calls run inside ``mpstream.profile``; their timeline
must read and hold sound spans (:func:`tests.random_sessions.check_profile`).
With emulated CUDA graphs a second backward and ``torch.autograd.grad`` of
parameters are left out (graphed stages refuse or do not give them, as
docs/tuning.md says). The pipe (:mod:`tests.random_sessions`) has some blocks
frozen (``requires_grad=False``), runs in float64, float32, bfloat16 or
float16, and often under ``torch.autocast`` (bfloat16 or float16), on 1-6
stages (up to six stages on one rank for the interleaved schedules) split
by ``torch.fx`` or ``torch.export``, with every built-in schedule or an
explicit order, deferred BatchNorm, and emulated CUDA graphs often, as
graphed stages re-key on batch size, mode and ``requires_grad``.

The plain model runs in the same dtype, under the same autocast; float32
and the 16-bit dtypes are compared within :data:`TOLERANCE` (a
micro-batch's matmuls sum in another order, and gradients accumulate over
micro-batches in the dtype itself). Refusals are accepted only where the
error says what to do: deferred BatchNorm on a module ``torch.export``
splits, an input returned unchanged by one (return ``x.clone()``), a
BatchNorm with ``momentum=None`` exported in training mode, and a
``train_step`` of another micro-batch count than its explicit order's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis", reason="a property test: needs hypothesis (the dev extra)")

import contextlib
import copy
import os
from dataclasses import replace
from typing import Any

import torch
from hypothesis import HealthCheck, event, given, note, settings
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from mpstream import NoChunk, Pipe, profile
from mpstream.schedules import parse
from tests.random_models import Recipe, Reference, build, leaves, micro_batches, random_order
from tests.random_sessions import (
    Call,
    Session,
    check_profile,
    make_pipe,
    micros,
    sessions,
    strict_hook,
)

#: (rtol, atol) per dtype; float64 is torch's default.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-3, 1e-4),  # BatchNorm of two samples amplifies reordered sums
    torch.bfloat16: (5e-2, 5e-2),
    torch.float16: (1e-2, 1e-2),  # 3 more mantissa bits than bfloat16
}


class Compare:
    """Comparisons within the session's dtype's tolerance."""

    def __init__(self, rtol: float, atol: float, noise: frozenset[str] = frozenset()) -> None:
        self.rtol, self.atol = rtol, atol
        # Gradients whose true value is zero, so that what either side holds
        # is rounding alone (compared for being set, not for their values).
        self.noise = noise

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
            if name in self.noise:
                assert (got[name].grad is None) == (p.grad is None), f"{what}: {name}"
                continue
            self.grad(got[name].grad, p.grad, f"{what}: gradient of {name}")
        buffers = dict(pipe.named_buffers())
        for name, b in ref.named_buffers():
            self.close(buffers[name], b, f"{what}: {name}")


def refused(recipe: Recipe, s: Session, training: bool) -> tuple[type[Exception], str] | None:
    """The error building the pipe (or exporting a call in ``training``
    mode) must raise, its type and part of its message, or None."""
    if s.tracer != "export":
        return None
    if s.deferred:
        return ValueError, "which cannot run DeferredBatchNorm; use tracer='fx'"
    if recipe.has_norm and recipe.momentum is None and training:
        # BatchNorm's float(num_batches_tracked) is data-dependent for
        # torch.export, which fails before the split looks at the outputs:
        # refused by name (stages/fake_export.py).
        return TypeError, "in training with momentum=None: it updates its running statistics"
    if any(i < len(recipe.inputs) for i in recipe.outputs):
        return TypeError, "the module returns one of its inputs unchanged"
    return None


def order_for(model: nn.Module, recipe: Recipe, s: Session) -> tuple[str, int, list[int] | None]:
    """A random explicit order for the session's first train_step's
    micro-batch count, the count, and the order the stage holding a
    BatchNorm forwards the micro-batches in (None without one)."""
    assert s.order_rng is not None
    reads = make_pipe(copy.deepcopy(model), s, recipe).graph.reads()
    steps = [c.batch for c in s.calls if c.kind == "train_step"]
    count = micros(steps[0] if steps else s.calls[0].batch, s)
    order = random_order(reads, count, s.order_rng)
    norms = [k for k, step in enumerate(recipe.steps) if step.norm]
    if not norms or s.deferred:
        return order, count, None
    stage = sum(cut <= norms[0] for cut in s.cuts)
    return order, count, [a.micro for a in parse(order) if a.kind == "F" and a.stage == stage]


def check(recipe: Recipe, s: Session) -> None:
    torch.manual_seed(s.seed)
    split = (s.chunks, s.split_size)
    half = {s.dtype, s.autocast} & {torch.float16, torch.bfloat16}
    # BatchNorm of one sample in training: the plain model refuses it. Of
    # two, it outputs +-1 whatever they are, so what feeds it gets no
    # gradient but rounding noise, scaled by their inverse spread: in half
    # precision each side's is its own, far apart (0.16 against 1e-3 in
    # float64). Such calls run in eval mode.
    fewest = 2 if half else 1
    modes = [
        c.training and not (recipe.has_norm and min(len(m) for m in micro_batches(
            torch.empty(c.batch), split)) <= fewest)
        for c in s.calls
    ]  # fmt: skip
    model = build(recipe, s.sequential).to(s.dtype).train(modes[0])  # exported in this mode
    blocks = model if s.sequential else model.blocks  # type: ignore[union-attr]
    for k in s.frozen:
        blocks[k].requires_grad_(False)  # type: ignore[index]
    ref = copy.deepcopy(model)
    order, count, norm_order = None, 0, None
    refusal = refused(recipe, s, modes[0])
    event("tracer", s.tracer)
    event("schedule", "order" if s.order_rng else "built-in")
    event("autocast", str(s.autocast))
    event("deferred", str(s.deferred))
    if refusal is not None:
        with pytest.raises(refusal[0], match=refusal[1]):
            make_pipe(model, s, recipe)
        event("outcome", "refused when built")
        return
    if s.order_rng is not None:
        order, count, norm_order = order_for(model, recipe, s)
        note(f"order: {order}")
    pipe = make_pipe(model, s, recipe, order)
    rtol, atol = TOLERANCE[s.dtype]
    if s.autocast is not None:
        rtol, atol = max(rtol, TOLERANCE[s.autocast][0]), max(atol, TOLERANCE[s.autocast][1])
    # The bias of a Linear a BatchNorm normalises has a zero gradient in
    # training mode (the norm takes its mean out); in half precision each
    # side's is its own rounding, up to ~1 after hooks scale it (so half
    # precision sessions compare it in eval mode neither).
    noise = frozenset(
        f"{'' if s.sequential else 'blocks.'}{k}.0.bias"
        for k, step in enumerate(recipe.steps)
        if step.norm and half
    )
    cmp = Compare(rtol, atol, noise)
    trainable = [name for name, p in ref.named_parameters() if p.requires_grad]
    event("frozen", "all" if not trainable else "some" if s.frozen else "none")
    event("dtype", str(s.dtype))
    event("graphs", str(s.graphs))
    scale = None
    if recipe.gain is not None:
        scale = torch.rand(recipe.gain_width(), dtype=s.dtype) + 0.5

    for i, (c, training) in enumerate(zip(s.calls, modes)):
        what = f"call {i} ({c.kind})"
        # Graphed stages refuse a second backward through one forward
        # (docs/tuning.md): with graphs, once.
        c = replace(c, retain=c.retain and not s.graphs)
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
        # A loss leaving out an output: graphed stages in the user's loop
        # call the hooks of an eager stage's dead values with None
        # (docs/tuning.md, graphed stages' differences).
        dead = s.graphs and c.ignore and c.kind != "train_step"
        for j in range(c.hooks if trainable else 0):  # spread over the blocks
            name = trainable[(i + j * max(1, len(trainable) // c.hooks)) % len(trainable)]
            # Strict: the pipe calls a hook only where the plain model does
            # (tests/pipe/test_dead_values.py), never with None.
            for module, none in ((pipe, dead), (ref, False)):
                hook = strict_hook(float(i + j + 2), f"{what}: hook on {name}", none)
                module.get_parameter(name).register_hook(hook)
        # Under autocast the plain model runs on the micro-batches too: a
        # reduced-precision kernel rounds its sums by the batch size.
        per_micro = recipe.has_norm and training or s.autocast is not None
        plain = Reference(ref, per_micro, split, deferred=s.deferred and training)
        if c.kind == "train_step":
            plain.micro_order = norm_order
        inputs = tuple(torch.randn(c.batch, w, dtype=s.dtype) for w in recipe.inputs)
        xs = tuple(t.clone().requires_grad_(c.input_grad) for t in inputs)
        rs = tuple(t.clone().requires_grad_(c.input_grad) for t in inputs)
        kw_pipe = {} if scale is None else {"scale": NoChunk(scale), "alpha": 0.5}
        kw_ref = {} if scale is None else {"scale": scale, "alpha": 0.5}
        autocast = (
            torch.autocast("cpu", dtype=s.autocast)
            if s.autocast is not None
            else contextlib.nullcontext()
        )
        refusal = refused(recipe, s, training) if training != modes[0] else None
        statistics = {n: b.clone() for n, b in ref.named_buffers()}
        timing = profile(pipe) if c.profiled else contextlib.nullcontext()
        try:
            with autocast, timing as prof:
                backward = call(pipe, plain, c, s, what, cmp, (xs, rs, inputs),
                                (kw_pipe, kw_ref, scale), (order, count))  # fmt: skip
        except (TypeError, ValueError) as e:
            if refusal is None or not isinstance(e, refusal[0]) or refusal[1] not in str(e):
                raise
            event("outcome", "refused at a call")
            with torch.no_grad():  # a train_step's plain forward ran first
                for name, t in ref.named_buffers():
                    t.copy_(statistics[name])
            cmp.state(pipe, ref, f"{what}: refused")
            return
        assert refusal is None, f"{what}: not refused"
        if prof is not None:
            passes = 2 if c.kind == "backward" and c.retain else 1
            check_profile(prof, s, c.kind, passes, backward, what)
        cmp.state(pipe, ref, what)
        if c.sgd:
            torch.optim.SGD(pipe.parameters(), lr=0.1).step()
            torch.optim.SGD(ref.parameters(), lr=0.1).step()
            cmp.state(pipe, ref, f"{what}: after SGD")
        # The next call starts from the pipe's values: rounding differences
        # within tolerance would otherwise compound, by far where a
        # BatchNorm normalises two samples a few ulps apart (bfloat16: one
        # ulp in a weight moved an output by 0.03, its gradient by 0.3).
        with torch.no_grad():
            for name, t in [*ref.named_parameters(), *ref.named_buffers()]:
                t.copy_(pipe.get_parameter(name) if isinstance(t, nn.Parameter)
                        else pipe.get_buffer(name))  # fmt: skip
        note(f"{what} passed")


def call(
    pipe: Pipe,
    plain: Reference,
    c: Call,
    s: Session,
    what: str,
    cmp: Compare,
    tensors: tuple[tuple[Tensor, ...], tuple[Tensor, ...], tuple[Tensor, ...]],
    kws: tuple[dict[str, Any], dict[str, Any], Tensor | None],
    order: tuple[str | None, int],
) -> bool:
    """Makes call ``c`` of the pipe and of the plain model, and compares
    what it returns and (after :meth:`Reference.settle`) nothing else.
    Returns whether the plain model's loss ran a backward."""
    (xs, rs, inputs), (kw_pipe, kw_ref, scale) = tensors, kws
    ref = plain.model

    def loss_fn(out: Any, target: Any) -> Tensor:
        pairs = list(zip(leaves(out), leaves(target)))
        if c.ignore and len(pairs) > 1:  # what only that leaf reads is a dead value
            pairs = pairs[1:]
        return sum(nn.functional.mse_loss(o, t) for o, t in pairs)  # type: ignore[return-value]

    if c.kind == "no_grad":
        with torch.no_grad():
            cmp.same(pipe(*xs, **kw_pipe), plain(*rs, **kw_ref), what)
        plain.settle()  # deferred BatchNorm's statistics, in training mode
        return False
    if c.kind == "train_step":
        return train_step(pipe, plain, c, s, what, cmp, inputs, (kw_ref, scale), order, loss_fn)
    if c.io_hooks:
        # An input only a left-out output reads: None from graphed stages,
        # as for an eager stage's dead value (docs/tuning.md).
        dead = s.graphs and c.ignore
        for x, r in zip(xs, rs):
            if x.requires_grad:
                x.register_hook(strict_hook(3.0, f"{what}: input hook", dead))
                r.register_hook(strict_hook(3.0, f"{what}: input hook"))
    out, expected = pipe(*xs, **kw_pipe), plain(*rs, **kw_ref)
    cmp.same(out, expected, what)
    if c.io_hooks:  # looking only: the pipe may return distinct tensors for one
        for t in [*leaves(out), *leaves(expected)]:
            if t.requires_grad:
                t.register_hook(strict_hook(None, f"{what}: output hook"))
    target = pytree.tree_map(torch.randn_like, expected)
    loss, want = loss_fn(out, target), loss_fn(expected, target)
    cmp.close(loss, want, f"{what}: loss")
    if not want.requires_grad:
        assert not loss.requires_grad, f"{what}: a loss that needs no gradient"
    elif c.kind == "backward":
        for _ in range(2 if c.retain else 1):  # the first keeps the graph when twice
            loss.backward(retain_graph=c.retain)  # type: ignore[no-untyped-call]
            want.backward(retain_graph=c.retain)  # type: ignore[no-untyped-call]
    else:  # torch.autograd.grad: some parameters and the inputs, no .grad set
        # Autograd sees no parameter of a graphed stage (docs/tuning.md):
        # with graphs, input gradients only.
        names = [] if s.graphs else [n for n, p in ref.named_parameters() if p.requires_grad][::2]
        wrt = [pipe.get_parameter(n) for n in names] + [x for x in xs if x.requires_grad]
        wrt_ref = [ref.get_parameter(n) for n in names] + [r for r in rs if r.requires_grad]
        if wrt:
            got = torch.autograd.grad(loss, wrt, allow_unused=True)
            expect = torch.autograd.grad(want, wrt_ref, allow_unused=True)
            for k, (g, e) in enumerate(zip(got, expect)):
                cmp.grad(g, e, f"{what}: autograd.grad of {(names + ['input'] * 2)[k]}")
    for x, r in zip(xs, rs):
        cmp.grad(x.grad, r.grad, f"{what}: input gradient")
    plain.settle()
    return bool(want.requires_grad)


def train_step(
    pipe: Pipe,
    plain: Reference,
    c: Call,
    s: Session,
    what: str,
    cmp: Compare,
    inputs: tuple[Tensor, ...],
    kws: tuple[dict[str, Any], Tensor | None],
    order: tuple[str | None, int],
    loss_fn: Any,
) -> bool:
    """A ``train_step`` call of the session (see :func:`call`)."""
    (kw_ref, scale), ref = kws, plain.model
    args: Any = inputs if len(inputs) > 1 else inputs[0]
    if scale is not None:
        args = (*inputs, NoChunk(scale), 0.5)
    count = micros(c.batch, s)
    if order[0] is not None and count != order[1]:
        # Refused before anything runs, saying what to give.
        with pytest.raises(ValueError, match=f"give an order for {count}"):
            pipe.train_step(args, inputs[0], loss_fn)  # refused before any loss
        event("outcome", "another micro-batch count than the order's: refused")
        return False
    statistics = {n: b.clone() for n, b in ref.named_buffers()}
    expected = plain(*inputs, **kw_ref)
    target = pytree.tree_map(lambda e: torch.randn_like(e.detach()), expected)
    want = loss_fn(expected, target)
    try:
        loss = pipe.train_step(args, target, loss_fn)
    except RuntimeError as e:
        # Every parameter the loss reads is frozen: refused, as the
        # plain backward is, the statistics its forwards wrote put back.
        assert not want.requires_grad and "does not require grad" in str(e), e
        for name, b in ref.named_buffers():
            b.copy_(statistics[name])
        plain.stats = None
        return False
    assert want.requires_grad, f"{what}: a loss that needs no gradient, not refused"
    want.backward()  # type: ignore[no-untyped-call]
    cmp.close(loss, want.detach(), f"{what}: loss")
    plain.settle()
    return True


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

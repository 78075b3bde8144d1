"""Random small models for property-based tests: a recipe, drawn by
hypothesis, and the ``torch.fx``-traceable module (or ``nn.Sequential``) it
describes.

A recipe is a chain of blocks (Linear, optionally BatchNorm1d, then Tanh,
ReLU or nothing) over float64 values. Each block reads any earlier value (an
input or a block's output) and may combine its output with another earlier
value (added when the widths match, else concatenated): skip connections.
The forward takes one or two inputs and returns the last value, or a tuple,
list or dict of it and any value (an input, or the last value again); two
blocks of one shape may share (tie) their Linear weight. A recipe with a
``gain`` block also takes ``scale`` (one tensor for the whole batch: a
Pipe's ``NoChunk``) and ``alpha`` (a float, by keyword), which multiply that
block's output.

Around them: :class:`Reference`, the plain model called as a Pipe's contract
says the Pipe equals it; :func:`random_order`, a valid explicit schedule
order for a pipe's stage graph; and comparisons of a Pipe with the model.
"""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis", reason="a property test: needs hypothesis (the dev extra)")

import copy
import random
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from mpstream import NoChunk
from mpstream.schedules import Action

ACTIVATIONS = ("tanh", "relu", "none")


@dataclass(frozen=True)
class Step:
    """One block: reads value ``source``, outputs ``width`` features, then
    adds or concatenates value ``skip`` when it is not None."""

    source: int
    width: int
    act: str
    norm: bool = False
    skip: int | None = None
    how: str = "add"


@dataclass(frozen=True)
class Recipe:
    """Input widths, blocks, the values returned (in a tuple, list or dict
    when several), an optional tied pair of blocks, BatchNorm's momentum.
    Values are numbered inputs first, then one per block."""

    inputs: tuple[int, ...]
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]
    tie: tuple[int, int] | None = None
    container: str = "tuple"
    momentum: float | None = 0.1
    gain: int | None = None  # the block scaled by forward's scale and alpha

    def widths(self) -> list[int]:
        """The width of every value."""
        widths = list(self.inputs)
        for step in self.steps:
            extra = widths[step.skip] if step.skip is not None and step.how == "cat" else 0
            widths.append(step.width + extra)
        return widths

    def gain_width(self) -> int:
        """The width of the gain block's output (``scale``'s length)."""
        assert self.gain is not None
        return self.widths()[len(self.inputs) + self.gain]

    @property
    def is_chain(self) -> bool:
        """Whether it is a plain chain: one input, each block reading the
        previous value, no skips or ties, the last value returned."""
        return (
            len(self.inputs) == 1
            and self.tie is None
            and self.gain is None
            and self.outputs == (len(self.steps),)
            and all(s.source == i and s.skip is None for i, s in enumerate(self.steps))
        )

    @property
    def has_norm(self) -> bool:
        return any(s.norm for s in self.steps)


def block(width_in: int, step: Step, momentum: float | None) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(width_in, step.width)]
    if step.norm:
        layers.append(nn.BatchNorm1d(step.width, momentum=momentum))
    if step.act != "none":
        layers.append(nn.Tanh() if step.act == "tanh" else nn.ReLU())
    return nn.Sequential(*layers)


def blocks(recipe: Recipe) -> nn.ModuleList:
    widths = recipe.widths()
    made = nn.ModuleList(block(widths[s.source], s, recipe.momentum) for s in recipe.steps)
    if recipe.tie is not None:
        i, j = recipe.tie
        made[j][0].weight = made[i][0].weight  # type: ignore[index]
    return made.double()


class RandomNet(nn.Module):
    """The module a recipe describes, over a ``forward(x)``."""

    def __init__(self, recipe: Recipe) -> None:
        super().__init__()
        self.recipe = recipe
        self.blocks = blocks(recipe)

    def run(
        self, inputs: tuple[Tensor, ...], scale: Tensor | None = None, alpha: float = 1.0
    ) -> Any:
        values = list(inputs)
        for k, (layer, step) in enumerate(zip(self.blocks, self.recipe.steps)):
            h = layer(values[step.source])
            if step.skip is not None:
                other = values[step.skip]
                h = h + other if step.how == "add" else torch.cat([h, other], dim=1)
            if k == self.recipe.gain:
                h = h * scale * alpha
            values.append(h)
        out = [values[i] for i in self.recipe.outputs]
        if len(out) == 1:
            return out[0]
        kind = self.recipe.container
        return tuple(out) if kind == "tuple" else out if kind == "list" else dict(zip("ab", out))

    def forward(self, x: Tensor) -> Any:
        return self.run((x,))


class RandomNet2(RandomNet):
    """The module a recipe with two inputs describes: ``forward(x, y)``."""

    def forward(self, x: Tensor, y: Tensor) -> Any:  # type: ignore[override]
        return self.run((x, y))


class GainNet(RandomNet):
    """A recipe with a gain block: ``forward(x, scale, alpha=1.0)``."""

    def forward(self, x: Tensor, scale: Tensor, alpha: float = 1.0) -> Any:  # type: ignore[override]
        return self.run((x,), scale, alpha)


class GainNet2(RandomNet):
    """A recipe with a gain block and two inputs: ``forward(x, y, scale, alpha=1.0)``."""

    def forward(self, x: Tensor, y: Tensor, scale: Tensor, alpha: float = 1.0) -> Any:  # type: ignore[override]
        return self.run((x, y), scale, alpha)


def build(recipe: Recipe, sequential: bool = False) -> nn.Module:
    """The recipe's module: an ``nn.Sequential`` of its blocks when asked
    (a chain only), else a traceable :class:`RandomNet`."""
    if sequential:
        assert recipe.is_chain
        return nn.Sequential(*blocks(recipe))
    two = len(recipe.inputs) == 2
    if recipe.gain is not None:
        return (GainNet2 if two else GainNet)(recipe)
    return (RandomNet2 if two else RandomNet)(recipe)


@st.composite
def recipes(draw: st.DrawFn, max_blocks: int = 6, norm: bool = True) -> Recipe:
    """A random recipe; chains are drawn often (they also run as a Sequential).
    At most one BatchNorm, so that deferred BatchNorm's whole-batch statistics
    are exact (see tests/memory/test_batchnorm.py)."""
    n_in = draw(st.sampled_from([1, 1, 2]))
    inputs = tuple(draw(st.integers(2, 6)) for _ in range(n_in))
    chain = n_in == 1 and draw(st.booleans())
    n = draw(st.sampled_from([*range(2, max_blocks + 1), *range(3, max_blocks + 1), 1]))
    norm_at = draw(st.integers(0, n - 1)) if norm and draw(st.booleans()) else None
    widths, steps = list(inputs), list[Step]()
    for k in range(n):
        here = len(widths)  # the index of the value this block makes
        source = here - 1 if chain else draw(st.integers(0, here - 1))
        width = draw(st.integers(2, 6))
        if k and not chain and draw(st.booleans()):  # an earlier block's shape (to tie)
            like = steps[draw(st.integers(0, k - 1))]
            fits = [i for i in range(here) if widths[i] == widths[like.source]]
            source, width = draw(st.sampled_from(fits)), like.width
        skip, how = None, "add"
        if not chain and draw(st.booleans()):
            same = [i for i in range(here) if widths[i] == width]
            how = draw(st.sampled_from(["add", "cat"])) if same else "cat"
            skip = draw(st.sampled_from(same if how == "add" else range(here)))
        step = Step(source, width, draw(st.sampled_from(ACTIVATIONS)), k == norm_at, skip, how)
        steps.append(step)
        widths.append(width + (widths[skip] if skip is not None and how == "cat" else 0))
    last = len(widths) - 1
    outputs: tuple[int, ...] = (last,)
    if not chain and draw(st.booleans()):
        outputs = (last, draw(st.integers(0, last)))  # an input, or the last value again
    shapes = [(s.width, widths[s.source]) for s in steps]
    pairs = [(i, j) for j in range(n) for i in range(j) if shapes[i] == shapes[j]]
    tie = draw(st.sampled_from(pairs)) if pairs and not chain and draw(st.booleans()) else None
    container = draw(st.sampled_from(["tuple", "list", "dict"]))
    momentum = draw(st.sampled_from([0.1, None]))
    gain = None if chain or draw(st.booleans()) else draw(st.integers(0, n - 1))
    return Recipe(inputs, tuple(steps), outputs, tie, container, momentum, gain)


def split_args(
    model: nn.Module,
    recipe: Recipe,
    cuts: tuple[int, ...],
    *,
    sequential: bool,
    tracer: str,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """Pipe's arguments splitting ``recipe``'s model before blocks ``cuts``:
    a balance for an ``nn.Sequential``, else split points, the tracer and,
    for ``torch.export``, a sample of the inputs in ``dtype``."""
    if sequential:
        bounds = [0, *cuts, len(model)]  # type: ignore[arg-type]
        return {"balance": [b - a for a, b in zip(bounds, bounds[1:])]}
    kw: dict[str, Any] = {"split_points": [f"blocks.{k}" for k in cuts], "tracer": tracer}
    if tracer == "export":
        sample: tuple[Any, ...] = tuple(torch.randn(2, w, dtype=dtype) for w in recipe.inputs)
        if recipe.gain is not None:  # alpha left out: calls give another (a new kind)
            sample += (NoChunk(torch.ones(recipe.gain_width(), dtype=dtype)),)
        kw["sample"] = sample
    return kw


def random_order(reads: tuple[tuple[int, ...], ...], micros: int, rng: random.Random) -> str:
    """A random valid explicit schedule order (see mpstream.schedules.orders):
    every forward and backward once, some backwards split into B and W, each
    action after those it depends on."""
    stages = len(reads)
    readers = [[q for q in range(stages) if p in reads[q]] for p in range(stages)]
    deps: dict[Action, list[Action]] = {}
    for s in range(stages):
        for m in range(micros):
            deps[Action("F", s, m)] = [Action("F", p, m) for p in reads[s] if p >= 0]
            deps[Action("B", s, m)] = [Action("F", s, m)] + [Action("B", q, m) for q in readers[s]]
            if rng.random() < 0.3:
                deps[Action("W", s, m)] = [Action("B", s, m)]
    done: list[Action] = []
    while len(done) < len(deps):
        ready = [a for a, d in deps.items() if a not in done and all(x in done for x in d)]
        done.append(rng.choice(ready))
    return " ".join(str(a) for a in done)


Split = tuple[int | None, int | None]  # a Pipe's (chunks, split_size)


def micro_batches(t: Tensor, split: Split) -> tuple[Tensor, ...]:
    """``t`` split as a Pipe splits it (torch.chunk / torch.split rules)."""
    chunks, split_size = split
    if chunks is not None:
        return t.chunk(chunks)
    return t.split(split_size) if split_size is not None else (t,)  # type: ignore[no-untyped-call]


def leaves(out: Any) -> list[Tensor]:
    return pytree.tree_leaves(out)


class Reference:
    """The plain model, called as a Pipe's contract says the Pipe equals it:
    on each micro-batch of ``split``, concatenated, when ``per_micro``
    (BatchNorm in training mode normalises each micro-batch on its own); with
    ``deferred`` (deferred BatchNorm in training mode), the statistics then
    those of one call on the whole batch (exact for one BatchNorm)."""

    def __init__(self, model: nn.Module, per_micro: bool, split: Split, deferred: bool) -> None:
        self.model, self.per_micro, self.split, self.deferred = model, per_micro, split, deferred
        self.stats: dict[str, Tensor] | None = None
        # The order micro-batches reach the BatchNorm: an explicit schedule
        # order may run them in any order, and plain BatchNorm's running
        # statistics depend on it.
        self.micro_order: list[int] | None = None

    def __call__(self, *inputs: Tensor, **whole_args: Any) -> Any:
        """The model on ``inputs`` (split along dim 0) and ``whole_args``
        (given whole to every micro-batch, by keyword)."""
        if self.deferred:
            whole = copy.deepcopy(self.model)
            with torch.no_grad():
                whole(*inputs, **whole_args)
            self.stats = dict(whole.named_buffers())  # set by settle()
        if not self.per_micro:
            return self.model(*inputs, **whole_args)
        micro = list(zip(*(micro_batches(t, self.split) for t in inputs)))
        order = self.micro_order or range(len(micro))
        done = {m: self.model(*micro[m], **whole_args) for m in order}
        parts = [done[m] for m in range(len(micro))]
        cat = [torch.cat(p) for p in zip(*map(leaves, parts))]
        return pytree.tree_unflatten(cat, pytree.tree_structure(parts[0]))

    def settle(self) -> None:
        """Sets deferred statistics, after the backward (the graph saved the
        running statistics, so they cannot change before)."""
        with torch.no_grad():
            for name, b in (self.stats or {}).items():
                self.model.get_buffer(name).copy_(b)
        self.stats = None


def close(a: Tensor, b: Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}")


def assert_same(a: Any, b: Any, what: str) -> None:
    """Same structure (tuple, list, dict) and close tensors."""
    assert pytree.tree_structure(a) == pytree.tree_structure(b), what
    for x, y in zip(leaves(a), leaves(b)):
        close(x, y, what)


def assert_same_grad(got: Tensor | None, want: Tensor | None, what: str) -> None:
    """Close gradients, or both None."""
    assert (got is None) == (want is None), f"{what}: {got} vs {want}"
    if got is not None and want is not None:
        close(got, want, what)


def assert_same_state(pipe: nn.Module, ref: nn.Module, what: str) -> None:
    """Every parameter gradient (None where the plain model's is None) and
    every buffer of the plain model (BatchNorm statistics)."""
    got, want = dict(pipe.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert_same_grad(got[name].grad, p.grad, f"{what}: gradient of {name}")
    buffers = dict(pipe.named_buffers())
    for name, b in ref.named_buffers():
        close(buffers[name], b, f"{what}: {name}")

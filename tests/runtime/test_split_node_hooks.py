"""Hooks on a junction's autograd node in a split backward: a prehook
(``grad_fn.register_prehook``), a posthook (``grad_fn.register_hook``) and
the deprecated ``Module.register_backward_hook`` (a posthook) run once per
micro-batch under every zero-bubble schedule, seeing what the plain
model's call saw, with the plain model's gradients. W takes them off the
node (``mpstream._C.MutedHooks``); a junction holding a posthook computes
its weight gradients in B (``mpstream._C.has_post_hooks``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from mpstream.runtime.boundary import GradSink, cut
from mpstream.runtime.split_backward import Split, backward_inputs
from mpstream.runtime.split_hooks import has_post_hooks, mute
from tests.helpers import assert_same_grads
from tests.runtime.test_split_hooks import ZERO_BUBBLE, Twice, hooked, model, pipe_of

# Torch's deprecation of Module.register_backward_hook, tested here on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:Using a non-full backward hook:FutureWarning")

Grads = tuple[Tensor | None, ...]


def _twice(grads: Grads) -> Grads:
    return tuple(None if g is None else 2 * g for g in grads)


class Recorder:
    """Puts one kind of hook on each forward call's node of a linear layer
    (an ``addmm``: its grad_inputs are the bias's, the input's and the
    transposed weight's gradients), and records what each call saw, the
    output's gradient last."""

    def __init__(self, kind: str, returning: bool) -> None:
        self.kind = kind
        self.returning = returning
        self.seen: list[Grads] = []

    def record(self, grads: Grads) -> None:
        self.seen.append(tuple(None if g is None else g.detach().clone() for g in grads))

    def attach(self, lin: nn.Module) -> None:
        if self.kind == "legacy_module_hook":

            def legacy(m: nn.Module, grad_in: Grads, grad_out: Grads) -> Grads | None:
                self.record(grad_in + grad_out)
                return _twice(grad_in) if self.returning else None

            lin.register_backward_hook(legacy)
        else:
            lin.register_forward_hook(self.forward_hook)

    def forward_hook(self, m: nn.Module, inputs: Any, out: Tensor) -> None:
        assert out.grad_fn is not None
        if self.kind == "prehook":

            def pre(grad_outputs: Grads) -> Grads | None:
                self.record(grad_outputs)
                return _twice(grad_outputs) if self.returning else None

            out.grad_fn.register_prehook(pre)
        else:

            def post(grad_inputs: Grads, grad_outputs: Grads) -> Grads | None:
                self.record(grad_inputs + grad_outputs)
                return _twice(grad_inputs) if self.returning else None

            out.grad_fn.register_hook(post)


KINDS = ["prehook", "posthook", "legacy_module_hook"]
# Per position of what a hook saw: the per-sample gradients (concatenated
# over micro-batches) and the rest, reductions over the batch (summed).
# A prehook sees grad_outputs; a posthook grad_inputs then grad_outputs.
PER_SAMPLE = {"prehook": {0}, "posthook": {1, 3}, "legacy_module_hook": {1, 3}}


def _same(a: Tensor | None, b: Tensor) -> bool:
    return a is not None and a.shape == b.shape and torch.allclose(a, b)


def assert_seen_as_in_the_plain_model(got: Recorder, plain: Recorder, split_size: int) -> None:
    """One call per micro-batch (told by the output's gradient it saw), and
    what the calls saw, put together, is what the plain model's one call
    saw."""
    ((*_, whole_out),) = plain.seen
    micros = torch.split(whole_out, split_size)  # type: ignore[arg-type]
    found = [m for call in got.seen for m, part in enumerate(micros) if _same(call[-1], part)]
    assert len(got.seen) == len(micros), "one call per micro-batch"
    assert sorted(found) == list(range(len(micros))), "one call per micro-batch"
    calls = [call for _, call in sorted(zip(found, got.seen), key=lambda s: s[0])]
    for k, expected in enumerate(plain.seen[0]):
        parts = [call[k] for call in calls]
        if expected is None:
            assert all(p is None for p in parts), k
            continue
        assert all(p is not None for p in parts), f"position {k}: {parts}"
        together = torch.cat(parts) if k in PER_SAMPLE[got.kind] else sum(parts)  # type: ignore[arg-type]
        torch.testing.assert_close(together, expected)


def recorders(m: nn.Module, kind: str, returning: bool) -> list[Recorder]:
    found = []
    for layer in hooked(m):
        found.append(Recorder(kind, returning))
        found[-1].attach(layer.lin)
    return found


@pytest.mark.parametrize("returning", [False, True], ids=["recording", "doubling"])
@pytest.mark.parametrize("split_size", [2, 3], ids=["dividing", "not_dividing"])
@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
@pytest.mark.parametrize("kind", KINDS)
def test_train_step_with_node_hooks_equals_the_plain_model(
    kind: str, schedule: str, split_size: int, returning: bool
) -> None:
    ref = model(None)
    pipe = pipe_of(ref, split_size, schedule)
    got, plain = recorders(pipe, kind, returning), recorders(ref, kind, returning)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    loss = pipe.train_step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipe, ref)
    for g, p in zip(got, plain, strict=True):
        assert_seen_as_in_the_plain_model(g, p, split_size)


@pytest.mark.parametrize("kind", KINDS)
def test_b_then_w_with_a_node_hook_at_a_junction(kind: str) -> None:
    """Outside a training step: the stage's input gradient too."""
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    twin = copy.deepcopy(stage)
    plain, got = Recorder(kind, True), Recorder(kind, True)
    plain.attach(stage[0])
    got.attach(twin[0])
    x, grad = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    sink, twin_sink = GradSink(), GradSink()
    torch.autograd.backward([stage(cut(sink, (x,))[0])], [grad])
    backward_inputs([twin(cut(twin_sink, (x,))[0])], [grad]).run()
    torch.testing.assert_close(twin_sink.grads, sink.grads)
    assert_same_grads(twin, stage)
    assert_seen_as_in_the_plain_model(got, plain, 5)


def test_a_junction_with_a_posthook_computes_its_weights_in_b() -> None:
    """A posthook sees every gradient of its node in one call: B computes
    that junction's; a prehook leaves them to W."""
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    eager = []
    for kind in ("prehook", "posthook"):
        out = stage(cut(GradSink(), (x,))[0])
        hidden = out.grad_fn.next_functions[1][0].next_functions[0][0]  # type: ignore[union-attr]
        if kind == "prehook":
            hidden.register_prehook(lambda grad_outputs: None)
        else:
            hidden.register_hook(lambda grad_inputs, grad_outputs: None)
        eager.append({id(p) for p in Split([out], None).eager})
    assert eager[0] == set()
    assert eager[1] == {id(p) for p in stage[0].parameters()}


@pytest.mark.parametrize("kind", ["operator", "custom_function"])
def test_mute_takes_a_nodes_prehooks_and_posthooks_off_until_restore(kind: str) -> None:
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    y = x * 2 if kind == "operator" else Twice.apply(x)
    node = y.grad_fn
    assert node is not None and not has_post_hooks(node)
    calls: list[str] = []
    node.register_prehook(lambda go: calls.append("pre"))
    node.register_prehook(lambda go: (go[0] + 1,))  # into the same dict
    node.register_hook(lambda gi, go: calls.append("post"))
    assert has_post_hooks(node)
    muted = mute(node)
    assert len(muted) == 2 and not has_post_hooks(node)
    # Registered while muted (as W's own prehook is): it runs, and stays after.
    late = node.register_prehook(lambda go: calls.append("late"))
    ones = torch.ones(3, dtype=torch.float64)
    y.backward(ones, retain_graph=True)
    assert calls == ["late"]
    torch.testing.assert_close(x.grad, 2 * ones)
    muted.restore()
    assert len(muted) == 0 and has_post_hooks(node)
    y.backward(ones)
    assert calls == ["late", "pre", "late", "post"]
    torch.testing.assert_close(x.grad, 2 * ones + 2 * (ones + 1))
    late.remove()


def test_has_post_hooks_refuses_what_is_not_an_autograd_node() -> None:
    with pytest.raises(TypeError, match="has_post_hooks takes an autograd node .*not Tensor"):
        has_post_hooks(torch.ones(2))  # type: ignore[arg-type]

"""A backward pass of the user's loop through graphed stages that fails part
way (a tensor hook raising, an interrupt, a post-accumulate hook raising in
a store's flush) leaves nothing to the next pass, even one that no forward
of the pipe precedes (forwards run ahead, the failed loss dropped): the
next pass gives the plain model's gradients and runs its hooks as the plain
model does (replays emulated on the CPU, see test_stages.py)."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated
from tests.helpers import assert_same_grads
from tests.runtime.graphed.test_grads import tied_model


def plain_and_graphed() -> tuple[nn.Module, Pipe, Tensor, Tensor]:
    """:func:`tied_model` and a graphed pipe of a copy of it in three CPU
    stages (the tied weight in side buffers of stages 0 and 2), which has
    captured, gradients None, and a batch with its targets."""
    plain = tied_model()
    graphed = Pipe(
        copy.deepcopy(plain), chunks=3, balance=[2, 2, 2], devices=["cpu"] * 3,
        graphs=Emulated(),
    )  # fmt: skip
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)
    nn.functional.mse_loss(graphed(x), y).backward()  # captures
    graphed.zero_grad(set_to_none=True)
    return plain, graphed, x, y


def count_hooks(model: nn.Module) -> Counter[str]:
    """Counts the post-accumulate hooks run per parameter of ``model``."""
    ran = Counter[str]()
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=name: ran.update([n]))
    return ran


def assert_nothing_left(pipe: Pipe) -> None:
    """No pass is open in the pipe's gradient stores, none holds hooks or
    side sums for a later one."""
    graphs = pipe._rt().worker.graphs
    assert graphs is not None
    for st in graphs.stages:
        store = st.store
        assert store is not None
        assert store._pass is None and store._end is None
        assert not store._hooks and not store._tied_hooks and not store._reached_side
    assert not graphs.tied._sides and not graphs.tied._pending and not graphs.tied._queued


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_the_pass_after_a_failed_one_with_no_forward_between_is_the_plain_model_s(
    error: type[BaseException],
) -> None:
    # Both forwards ran before the first backward: no forward of the pipe
    # between the failed pass and the next one forgets what it left.
    plain, graphed, x, y = plain_and_graphed()
    ran = {id(m): count_hooks(m) for m in (plain, graphed)}
    for m in (plain, graphed):
        inp = x.clone().requires_grad_()
        failing = m(inp)  # its replays run, then the hook on its input raises
        inp.register_hook(lambda g: (_ for _ in ()).throw(error("hook failed")))
        kept = m(x)
        with pytest.raises(error, match="hook failed"):
            nn.functional.mse_loss(failing, y).backward()
        m.zero_grad(set_to_none=True)
        ran[id(m)].clear()
        nn.functional.mse_loss(kept, y).backward()
    assert_same_grads(graphed, plain)
    assert ran[id(graphed)] == ran[id(plain)]
    assert_nothing_left(graphed)


def test_a_hook_raising_in_a_flush_leaves_the_next_pass_its_tied_sums() -> None:
    # The tied weight's sums wait for a final callback queued behind every
    # store's flush; a hook raising in an earlier flush drops it with the
    # pass, and the next pass, with no forward between, must queue its own.
    plain, graphed, x, y = plain_and_graphed()
    for m in (plain, graphed):
        failing = [True]

        def hook(p: Tensor, failing: list[bool] = failing) -> None:
            if failing.pop() if failing else False:
                raise RuntimeError("hook failed")

        m[0].bias.register_post_accumulate_grad_hook(hook)  # stage 0's: the last flush
        outs = [m(x), m(x)]
        with pytest.raises(RuntimeError, match="hook failed"):
            nn.functional.mse_loss(outs[0], y).backward()
        m.zero_grad(set_to_none=True)
        nn.functional.mse_loss(outs[1], y).backward()
    assert_same_grads(graphed, plain)
    assert_nothing_left(graphed)

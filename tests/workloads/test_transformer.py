"""The transformer workload: its presets, its counts, and every way the
bench trains it equal to the unsplit model (loss and every gradient)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpstream import Pipe
from mpstream.runtime.graphed import Emulated
from mpstream.schedules import SCHEDULES, placement_of
from mpstream.workloads import transformer as T
from tests.helpers import assert_same_grads

TINY = T.preset("tiny")


def unsplit() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tiny model in float64, a batch, and its loss backward-ed."""
    model = T.decoder(TINY).double()
    x, y = T.tokens(TINY)
    loss = T.loss_fn(model(x), y)
    loss.backward()
    return model, x, y, loss.detach()


def test_the_presets_are_what_they_say() -> None:
    p1b = T.PRESETS["1b"]
    assert 1.0e9 < T.param_count(p1b) < 1.3e9
    assert 2.5e9 < T.param_count(T.PRESETS["3b"]) < 3.5e9
    assert T.param_count(TINY) == sum(p.numel() for p in T.decoder(TINY).parameters())
    # About 6 x parameters per token, plus attention.
    assert 6 * T.param_count(p1b, embedding=False) < T.flops_per_token(p1b) < 8e9
    with pytest.raises(ValueError, match="unknown transformer preset 'huge'; valid: tiny"):
        T.preset("huge")
    with pytest.raises(ValueError, match=r"counts .* must lie in 1..8 .*--micro-batches"):
        T.preset("tiny", micro_batches=(16,))
    with pytest.raises(ValueError, match="split into 5 heads"):
        T.preset("tiny", heads=5)
    with pytest.raises(ValueError, match="preset tiny: depth must be at least 1, got 0"):
        T.preset("tiny", depth=0)
    with pytest.raises(ValueError, match="preset tiny: heads must be at least 1, got 0"):
        T.preset("tiny", heads=0)
    with pytest.raises(TypeError, match="preset tiny: width must be an int, got float"):
        T.preset("tiny", width=64.0)
    with pytest.raises(ValueError, match=r"counts \(\) must lie in 1..8"):
        T.preset("tiny", micro_batches=())
    with pytest.raises(TypeError, match=r"got str 'tiny': use decoder\(preset\('tiny'\)\)"):
        T.decoder("tiny")  # type: ignore[arg-type]


def test_the_halves_put_the_embedding_and_the_head_on_the_ends() -> None:
    assert T.halves(TINY) == [3, 3]
    assert T.halves(T.preset("tiny", depth=5), 3) == [3, 2, 2]


@pytest.mark.parametrize("stages", [0, -1, 2.0])
def test_the_halves_name_a_bad_stage_count(stages: object) -> None:
    with pytest.raises(ValueError, match="stages must be a positive int, got"):
        T.halves(TINY, stages)  # type: ignore[arg-type]


def test_naive_model_parallel_is_the_unsplit_model() -> None:
    model, x, y, loss = unsplit()
    naive = T.NaiveParallel(copy.deepcopy(model), T.halves(TINY), [torch.device("cpu")] * 2)
    naive.zero_grad()
    got = T.loss_fn(naive(x), y)
    got.backward()
    torch.testing.assert_close(got, loss)
    assert_same_grads(naive.parts, nn.Sequential(*model))  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("chunks", [2, 3])  # 3 does not divide the batch of 8
def test_every_schedule_trains_equal_to_the_unsplit_model(
    schedule: str, checkpoint: str, chunks: int
) -> None:
    model, x, y, loss = unsplit()
    several = placement_of(schedule) != "stage"  # two ranks of two stages (round-robin or a V)
    balance = [2, 1, 2, 1] if several else T.halves(TINY)
    pipe = Pipe(
        copy.deepcopy(model), balance=balance, devices=["cpu"] * len(balance), chunks=chunks,
        schedule=schedule, checkpoint=checkpoint, virtual_stages=2 if several else None,
    )  # fmt: skip
    pipe.zero_grad()
    got = pipe.train_step(x, y, T.loss_fn)
    torch.testing.assert_close(got, loss)
    assert_same_grads(pipe, model)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_graphed_stages_train_equal_to_the_unsplit_model(schedule: str) -> None:
    model, x, y, loss = unsplit()
    pipe = Pipe(
        copy.deepcopy(model), balance=T.halves(TINY), devices=["cpu"] * 2, chunks=4,
        schedule=schedule, graphs=Emulated(),
    )  # fmt: skip
    for _ in range(2):  # capture, then replay
        pipe.zero_grad()
        torch.testing.assert_close(pipe.train_step(x, y, T.loss_fn), loss)
    assert_same_grads(pipe, model)
    pipe.zero_grad()
    T.loss_fn(pipe(x), y).backward()  # the user's own loop too
    assert_same_grads(pipe, model)


def test_the_decoder_is_made_on_its_device_the_same_on_every_call() -> None:
    # The bench builds fifteen 1b models: drawn on the CPU (one thread) each
    # took 5-10 s of a GPU lease; on the device itself, none of it.
    on = T.decoder(T.PRESETS["1b"], "meta")  # nothing allocated, nothing drawn on the CPU
    assert {q.device.type for q in on.parameters()} == {"meta"}
    assert {b.device.type for b in on.buffers()} == {"meta"}
    assert sum(q.numel() for q in on.parameters()) == T.param_count(T.PRESETS["1b"])
    state = torch.get_rng_state()
    for a, b in zip(T.decoder(TINY, "cpu").parameters(), T.decoder(TINY).parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The caller's random streams are not reseeded (its dropout masks, say).
    assert torch.equal(torch.get_rng_state(), state)


def test_the_loss_is_float32_at_least() -> None:
    # bf16 logits are upcast for a stable softmax; float64 ones (the tests'
    # exact comparisons) must not be rounded down to float32.
    logits, target = torch.randn(2, 3, 5, dtype=torch.float64), torch.tensor([[1, 2, 3]] * 2)
    assert T.loss_fn(logits, target).dtype == torch.float64
    assert T.loss_fn(logits.bfloat16(), target).dtype == torch.float32

"""Graphed stages on kinds of models: plain and deferred BatchNorm, convolutions
with residual blocks, skips and multi-argument stages, a stage beginning
with an in-place op, a Hugging Face model split by torch.export; each equal
to the eager pipe (replays emulated on the CPU, see test_stages.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torchvision.models.resnet import Bottleneck

from mpstream.runtime.graphed import Emulated
from mpstream.schedules import SCHEDULES, placement_of
from tests.helpers import assert_same_grads
from tests.models import Fan, UNet
from tests.runtime.graphed.pairs import data, pair


def test_deferred_batch_norm_counts_replayed_forwards() -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).double()
    eager, graphed = pair(model, chunks=2, balance=[2, 1], deferred_batch_norm=True)
    x, y = data()
    for _ in range(2):
        for pipe in (eager, graphed):
            pipe.train_step(x, y, nn.MSELoss())
    for a, b in zip(graphed.buffers(), eager.buffers()):
        torch.testing.assert_close(a, b)


def test_deferred_batch_norm_captured_is_not_said_to_run_twice_per_micro_batch() -> None:
    # Capture runs the stage once more per micro-batch; it was counted as a
    # call: "ran 4 times in a mini-batch of 2 micro-batches", warned at the
    # first call (and, warned once, a real second use went unsaid).
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).double()
    _, graphed = pair(model, chunks=2, balance=[2, 1], deferred_batch_norm=True)
    x, y = data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graphed(x)
        graphed.train_step(x, y, nn.MSELoss())
    assert not graphed.partitions[0][1].warned


def test_plain_batch_norm_captured_between_a_forward_and_its_backward() -> None:
    # BatchNorm saves its running statistics for backward; capturing the
    # next slot puts them back, which must not count as a modification.
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).double()
    eager, graphed = pair(model, chunks=2, balance=[2, 1], schedule="gpipe")
    x, y = data()
    for _ in range(2):
        losses = [pipe.train_step(x, y, nn.MSELoss()) for pipe in (eager, graphed)]
        torch.testing.assert_close(losses[1], losses[0])
    assert_same_grads(graphed, eager)
    for a, b in zip(graphed.buffers(), eager.buffers()):
        torch.testing.assert_close(a, b)


def convnet() -> nn.Sequential:
    """Convolutions with plain BatchNorm and residual blocks, 8 layers."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        Bottleneck(8, 2), Bottleneck(8, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    ).double()  # fmt: skip


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_convnet_with_batch_norm_equals_the_eager_pipe(schedule: str) -> None:
    extra = (
        {"virtual_stages": 2, "balance": [2, 2, 2, 2], "devices": ["cpu"] * 4}
        if placement_of(schedule) != "stage"
        else {}
    )
    eager, graphed = pair(convnet(), split_size=2, schedule=schedule, **extra)
    x = torch.randn(5, 3, 6, 6, dtype=torch.float64)
    y = torch.randn(5, 4, dtype=torch.float64)
    for _ in range(2):
        losses = [pipe.train_step(x, y, nn.MSELoss()) for pipe in (eager, graphed)]
        torch.testing.assert_close(losses[1], losses[0])
    assert_same_grads(graphed, eager)
    for a, b in zip(graphed.buffers(), eager.buffers()):
        torch.testing.assert_close(a, b)


def test_a_hugging_face_model_split_by_torch_export_replays_equal_to_eager() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()
    ids = torch.randint(0, 64, (5, 8))
    batch = {"input_ids": ids, "labels": ids}
    eager, graphed = pair(
        model, chunks=3, split_points=["transformer.h.1"], balance=None, schedule="1f1b"
    )
    for _ in range(2):  # the user's loop with the model's own loss, then train_step
        for pipe in (eager, graphed):
            pipe.zero_grad()
            pipe(**batch).loss.backward()
        assert_same_grads(graphed, eager)
    for pipe in (eager, graphed):
        pipe.zero_grad()
        pipe.train_step(batch)
    assert_same_grads(graphed, eager)
    assert graphed.graph_report().graphs > 0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_skips_multi_argument_stages_and_a_plain_argument(schedule: str) -> None:
    # Fan: stage 0's output read by three later stages, a float argument
    # baked into the graphs (part of the call's key).
    eager, graphed = pair(
        Fan().double(), split_points=["a", "b", "c"], devices=["cpu"] * 4, balance=None,
        split_size=2, schedule=schedule, checkpoint="except_last",
    )  # fmt: skip
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    for scale in (2.0, 2.0, 3.0):
        for pipe in (eager, graphed):
            pipe.zero_grad()
            nn.functional.mse_loss(pipe(x, scale), y).backward()
        assert_same_grads(graphed, eager)
    eager_unet, graphed_unet = pair(
        UNet().double(), split_points=["down2", "mid", "up2", "up1"], devices=["cpu"] * 5,
        balance=None, split_size=2, schedule=schedule,
    )  # fmt: skip
    img = torch.randn(5, 1, 8, 8, dtype=torch.float64)
    for pipe in (eager_unet, graphed_unet):
        pipe.train_step(img, img, nn.MSELoss())
    assert_same_grads(graphed_unet, eager_unet)
    if schedule == "zb_h1":  # stages of several inputs split into B and W
        passes = [s.passes for s in graphed_unet.graph_report().stages]
        assert all("weight" in p for p in passes[1:]), passes


def test_a_stage_beginning_with_an_in_place_op_is_graphed() -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 4)).double()
    eager, graphed = pair(model, chunks=2, balance=[1, 2])
    x, y = data()
    for pipe in (eager, graphed):
        nn.functional.mse_loss(pipe(x), y).backward()
    assert_same_grads(graphed, eager)
    assert all(s.graphed for s in graphed.graph_report().stages)


def test_deferred_batch_norm_never_commits_inside_a_capture() -> None:
    # train_step does not hold the statistics, so the mini-batch's last
    # forward commits them; captured, that commit would run at every replay.
    seen: list[bool] = []

    class Watching(Emulated):
        def capture(self, call: object, fn: object) -> None:
            seen.extend(n.hold for n in call.norms)  # type: ignore[attr-defined]
            super().capture(call, fn)  # type: ignore[arg-type]

    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).double()
    eager, graphed = pair(model, graphs=Watching(), chunks=1, balance=[2, 1],
                          deferred_batch_norm=True)  # fmt: skip
    x, y = data()
    for pipe in (eager, graphed):
        pipe.train_step(x, y, nn.MSELoss())
    assert seen and all(seen)
    for a, b in zip(graphed.buffers(), eager.buffers()):
        torch.testing.assert_close(a, b)
    norm = graphed.partitions[0][1]
    assert not norm.hold and norm.tracked == 0  # put back as they were, then committed

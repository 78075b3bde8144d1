"""Graphed stages on a GPU: real CUDA graphs against the eager pipe (every
schedule and checkpoint mode, float64), launches per step, the sanitizer, and
what only a GPU can settle (dropout with checkpointing, dropout in stages
sharing a GPU, a capture that fails, deferred BatchNorm, a second backward,
tied weights, a pinning DataLoader beside a capture).
Skipped without CUDA; the CPU tests are in test_stages.py."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe
from mpstream.runtime.graphed import CudaGraphs, GraphWarning
from mpstream.schedules import SCHEDULES, placement_of
from tests.helpers import assert_same_grads, mlp
from tests.runtime.graphed.pairs import CHECKPOINTS, WIDTHS, data, pair
from tests.runtime.graphed.test_call import SPLIT_STAGES, check_split
from tests.runtime.test_handoffs import in_place


@pytest.mark.cuda
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_cuda_graphs_equal_the_eager_pipe(schedule: str, checkpoint: str) -> None:
    extra = (
        {"virtual_stages": 2, "balance": [2, 2, 2, 2], "devices": ["cuda:0"] * 4}
        if placement_of(schedule) != "stage"
        else {"devices": ["cuda:0", "cuda:0"]}
    )
    eager, graphed = pair(
        mlp(WIDTHS), graphs=True, split_size=3, schedule=schedule, checkpoint=checkpoint, **extra
    )
    x, y = (t.cuda() for t in data())
    for _ in range(3):  # capture, then replays
        losses = []
        for pipe in (eager, graphed):
            pipe.zero_grad()
            losses.append(pipe.train_step(x, y, nn.MSELoss()))
        torch.testing.assert_close(losses[1], losses[0])
        assert_same_grads(graphed, eager)
    for _ in range(2):  # the user's own loop
        for pipe in (eager, graphed):
            pipe.zero_grad()
            nn.functional.mse_loss(pipe(x), y).backward()
        assert_same_grads(graphed, eager)
    report = graphed.graph_report()
    assert all(s.graphed for s in report.stages), str(report)
    assert report.graphs > 0 and all(s.reserved_bytes >= 0 for s in report.stages)
    if schedule in ("zb_h1", "interleaved_zb", "zbv") and checkpoint != "always":
        assert all("weight" in s.passes for s in report.stages), str(report)


@pytest.mark.cuda
def test_cuda_the_users_loop_reads_the_producer_s_buffers_in_place() -> None:
    # Two forwards before one backward: the second replays other graphs of
    # the producer, and the reader graphs of its own that read those.
    eager, graphed = pair(mlp(WIDTHS), graphs=True, chunks=3, devices=["cuda:0", "cuda:0"])
    x, y = (t.cuda() for t in data())
    for _ in range(3):  # capture, then replays
        for pipe in (eager, graphed):
            pipe.zero_grad()
            loss = nn.functional.mse_loss(pipe(x), y) + nn.functional.mse_loss(pipe(2 * x), y)
            loss.backward()
        assert_same_grads(graphed, eager)
    assert in_place(graphed, 0, 1) == (True, True)


@pytest.mark.cuda
def test_cuda_graphs_issue_fewer_launches_than_eager() -> None:
    eager, graphed = pair(
        mlp([6] + [64] * 12 + [4]), graphs=True, chunks=4, balance=[13, 13],
        devices=["cuda:0", "cuda:0"],
    )  # fmt: skip
    x, y = (t.cuda() for t in data(16))
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]

    def launches(pipe: Pipe) -> tuple[int, int]:
        for _ in range(2):  # capture, then replay
            pipe.zero_grad()
            pipe.train_step(x, y, nn.MSELoss())
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            pipe.zero_grad()
            pipe.train_step(x, y, nn.MSELoss())
            torch.cuda.synchronize()
        names = [e.name for e in prof.events()]
        graphs = sum("cudaGraphLaunch" in n for n in names)
        return graphs, sum(n.startswith("cudaLaunchKernel") for n in names)

    eager_graphs, eager_kernels = launches(eager)
    replays, kernels = launches(graphed)
    assert eager_graphs == 0 and replays == 2 * 2 * 4  # forward and backward per stage, micro
    assert kernels < eager_kernels / 2  # copies in, the loss: not every layer's


@pytest.mark.cuda
def test_cuda_zero_bubble_replays_input_and_weight_passes_apart() -> None:
    eager, graphed = pair(
        mlp([6, 64, 64, 64, 4]), graphs=True, chunks=4, balance=[4, 4], schedule="zb_h1",
        devices=["cuda:0", "cuda:0"],
    )  # fmt: skip
    x, y = (t.cuda() for t in data(16))
    for _ in range(2):  # capture, then replay
        graphed.zero_grad()
        graphed.train_step(x, y, nn.MSELoss())
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for pipe in (eager, graphed):
            pipe.zero_grad()
            pipe.train_step(x, y, nn.MSELoss())
        torch.cuda.synchronize()
    assert_same_grads(graphed, eager)
    replays = sum("cudaGraphLaunch" in e.name for e in prof.events())
    # Per micro-batch: the first stage's forward and W (its inputs need no
    # gradient: no B graph); the second's forward, B and W.
    assert replays == 4 * (2 + 3)
    assert [s.passes for s in graphed.graph_report().stages] == [
        ("forward", "weight"),
        ("forward", "backward", "weight"),
    ]


GRAPHED_UNDER_CSAN = """
import torch
from torch import nn
from mpstream import Pipe, verify_plan
from mpstream.doctor.sanitizer import csan_workarounds

def run():
    torch.manual_seed(0)
    for schedule in ("gpipe", "1f1b", "zb_h1"):
        for checkpoint in ("never", "except_last"):
            model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(2)])
            pipe = Pipe(model, split_size=4, balance=[1, 1], devices=["cuda:0", "cuda:0"],
                        schedule=schedule, checkpoint=checkpoint, force_copies=True, graphs=True)
            opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
            for _ in range(3):
                opt.zero_grad()
                pipe.train_step(torch.randn(10, 64), torch.randn(10, 64), nn.MSELoss())
                opt.step()
                opt.zero_grad()
                pipe(torch.randn(10, 64, device="cuda:0")).pow(2).mean().backward()
                opt.step()
            assert all(s.graphed for s in pipe.graph_report().stages), pipe.graph_report()
    # Dropout in both stages: captures and random replays of the two stage
    # streams take turns on the generator's graph scalars (runtime.graphed.rng).
    for schedule in ("1f1b", "zb_h1"):
        layers = [nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.1)) for _ in range(2)]
        model = nn.Sequential(*layers)
        pipe = Pipe(model, split_size=4, balance=[1, 1], devices=["cuda:0", "cuda:0"],
                    schedule=schedule, force_copies=True, graphs=True)
        for _ in range(3):
            pipe.train_step(torch.randn(10, 64), torch.randn(10, 64), nn.MSELoss())
        assert all(s.graphed for s in pipe.graph_report().stages), pipe.graph_report()
    torch.cuda.synchronize()

with csan_workarounds():
    run()
print("sanitized run finished")
"""


@pytest.mark.cuda
def test_cuda_sanitizer_reports_no_race_around_graph_replays() -> None:
    # CSAN sees the copies into and out of the static buffers around each
    # replay (a replay itself is one launch it cannot look into).
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    result = subprocess.run(
        [sys.executable, "-c", GRAPHED_UNDER_CSAN],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "CSAN detected" not in result.stderr, result.stderr[-4000:]
    assert result.returncode == 0, result.stderr[-4000:]
    assert "sanitized run finished" in result.stdout


# -- what only a GPU can settle (an independent review's experiments) --------


@pytest.mark.cuda
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_cuda_dropout_with_and_without_checkpointing_equals_eager(checkpoint: str) -> None:
    # A checkpointed stage that draws random numbers runs eagerly (its
    # recomputation inside a graph would draw other numbers); without
    # checkpointing the graph draws what the eager pipe draws.
    model = nn.Sequential(nn.Linear(6, 64), nn.Dropout(0.5), nn.Linear(64, 4), nn.Tanh()).double()
    eager, graphed = pair(model, graphs=True, chunks=2, balance=[3, 1],
                          devices=["cuda:0", "cuda:0"], checkpoint=checkpoint)  # fmt: skip
    x, y = (t.cuda() for t in data())
    for step in range(3):
        for pipe in (eager, graphed):
            pipe.zero_grad()
            torch.manual_seed(step)
            pipe.train_step(x, y, nn.MSELoss())
        assert_same_grads(graphed, eager)
    graphed_first = graphed.graph_report().stages[0].graphed
    assert graphed_first == (checkpoint == "never"), str(graphed.graph_report())


@pytest.mark.cuda
def test_cuda_dropout_in_stages_sharing_a_gpu_equals_eager() -> None:
    # Both stages' forward graphs draw random numbers: their replays take
    # turns on the generator's graph scalars, in the eager pipe's order.
    model = nn.Sequential(
        nn.Linear(6, 256), nn.Dropout(0.5), nn.Linear(256, 256), nn.Dropout(0.5), nn.Linear(256, 4)
    ).double()
    eager, graphed = pair(model, graphs=True, chunks=4, balance=[2, 3], schedule="1f1b",
                          devices=["cuda:0", "cuda:0"])  # fmt: skip
    x, y = (t.cuda() for t in data(32))
    for step in range(4):
        for pipe in (eager, graphed):
            pipe.zero_grad()
            torch.manual_seed(step)
            pipe.train_step(x, y, nn.MSELoss())
        assert_same_grads(graphed, eager)
    graphs = graphed._rt().worker.graphs
    assert graphs is not None
    calls = [c for st in graphs.stages for c in st.calls.values()]
    assert calls and all(c.random_passes == {"forward"} for c in calls)


class Syncs(nn.Module):
    """Reads a value back to the host, which no capture can hold."""

    def forward(self, x: Tensor) -> Tensor:
        return x * 2 if x.sum().item() > 1e9 else x


@pytest.mark.cuda
@pytest.mark.parametrize("syncing", ["item", "cumulative batch norm"])
def test_cuda_a_capture_that_fails_leaves_torch_as_it_was(syncing: str) -> None:
    # The stage runs eagerly, with one warning naming the sync's own error
    # (not capture_end's); the allocator has no capture left underway
    # (empty_cache asserts otherwise) and the generator is out of capture
    # mode (an eager dropout raises otherwise).
    layer = Syncs() if syncing == "item" else nn.BatchNorm1d(12, momentum=None)
    model = nn.Sequential(nn.Linear(6, 12), layer, nn.Linear(12, 4)).double()
    eager, graphed = pair(model, graphs=True, chunks=2, balance=[1, 2],
                          devices=["cuda:0", "cuda:0"])  # fmt: skip
    x, y = (t.cuda() for t in data())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            losses = [pipe.train_step(x, y, nn.MSELoss()) for pipe in (eager, graphed)]
            torch.testing.assert_close(losses[1], losses[0])
    fell = [str(w.message) for w in caught if issubclass(w.category, GraphWarning)]
    assert len(fell) == 1, fell
    assert re.search(r"stage 1 of 2 .*runs eagerly: capture failed: ", fell[0]), fell[0]
    assert "previous error during capture" not in fell[0]
    assert [s.graphed for s in graphed.graph_report().stages] == [True, False]
    assert_same_grads(graphed, eager)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    kept = nn.functional.dropout(torch.ones(1000, device="cuda"), 0.5)
    assert 0 < int((kept == 0).sum()) < 1000
    for _ in range(2):  # and the stage that still replays keeps doing so
        graphed.train_step(x, y, nn.MSELoss())
    torch.cuda.synchronize()


@pytest.mark.cuda
@pytest.mark.parametrize("chunks", [1, 3])
def test_cuda_deferred_batch_norm_statistics_equal_eager(chunks: int) -> None:
    model = nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)).double()
    eager, graphed = pair(model, graphs=True, chunks=chunks, balance=[2, 1],
                          devices=["cuda:0", "cuda:0"], deferred_batch_norm=True)  # fmt: skip
    x, y = (t.cuda() for t in data(12))
    for _ in range(4):
        for pipe in (eager, graphed):
            pipe.train_step(x, y, nn.MSELoss())
    for a, b in zip(graphed.buffers(), eager.buffers()):
        torch.testing.assert_close(a, b)


@pytest.mark.cuda
def test_cuda_a_second_backward_is_refused_and_reserved_memory_is_counted() -> None:
    _, graphed = pair(mlp(WIDTHS), graphs=True, chunks=1, devices=["cuda:0", "cuda:0"])
    x, y = (t.cuda() for t in data())
    for _ in range(2):
        graphed.zero_grad()
        nn.functional.mse_loss(graphed(x), y).backward()
    loss = nn.functional.mse_loss(graphed(x), y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second backward"):
        loss.backward()
    reserved = [s.reserved_bytes for s in graphed.graph_report().stages]
    assert all(0 < r <= torch.cuda.memory_reserved() for r in reserved), reserved
    # Each stage's output gradients (and the first's input) sit outside the pools.
    static = [s.static_bytes for s in graphed.graph_report().stages]
    assert all(0 < b <= torch.cuda.memory_allocated() for b in static), static


@pytest.mark.cuda
def test_cuda_tied_weights_on_one_gpu_equal_eager() -> None:
    from tests.pipe import test_tied

    eager, graphed = pair(test_tied.tied_model(), graphs=True, chunks=3, balance=[2, 1, 2],
                          devices=["cuda:0"] * 3, schedule="1f1b")  # fmt: skip
    x, y = (t.cuda() for t in test_tied.data())
    for _ in range(3):  # no zero_grad: gradients accumulate across steps
        for pipe in (eager, graphed):
            pipe.train_step(x, y, nn.MSELoss())
    assert_same_grads(graphed, eager)


@pytest.mark.cuda
def test_cuda_capture_beside_a_pinning_data_loader() -> None:
    # Capture is thread-local: the loader's pin-memory thread keeps working.
    from torch.utils.data import DataLoader, TensorDataset

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    _, graphed = pair(model, graphs=True, chunks=4, balance=[2, 1], devices=["cuda:0"] * 2)
    data_set = TensorDataset(torch.randn(2048, 64), torch.randn(2048, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphWarning)
        for batch in (64, 96, 128):
            loader = DataLoader(data_set, batch_size=batch, pin_memory=True, num_workers=2)
            for x, y in loader:
                graphed.train_step(x, y, nn.MSELoss())
    assert all(s.graphed for s in graphed.graph_report().stages)


@pytest.mark.cuda
@pytest.mark.parametrize("name", SPLIT_STAGES)
def test_cuda_b_and_w_graphs_give_a_plain_backward_s_gradients(name: str) -> None:
    # A graphed call's split backward on its own, as a training step's
    # backward and weight tasks replay it.
    torch.manual_seed(0)
    make, shape = SPLIT_STAGES[name]
    x = torch.randn(*shape, dtype=torch.float64, device="cuda")
    # Outside a pipe nothing gives the call a stream of its own, and CUDA
    # graphs cannot be captured on the default stream.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        check_split(make().cuda(), x, CudaGraphs(), steps=3)
    torch.cuda.current_stream().wait_stream(side)


@pytest.mark.cuda
@pytest.mark.parametrize("how", ["own loop", "train_step"])
def test_cuda_graph_gradients_reach_grad_on_a_side_caller_stream(how: str) -> None:
    # The graphs add into .grad on the stage streams; the caller's stream
    # waits for them (the step's join; a final callback of the backward
    # pass in the user's loop): a caller on a stream of its own sees them.
    eager, graphed = pair(
        mlp(WIDTHS), graphs=True, chunks=4, devices=["cuda:0", "cuda:0"]
    )  # fmt: skip
    x, y = (t.cuda() for t in data())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for pipe in (eager, graphed):
                pipe.zero_grad(set_to_none=True)
                if how == "train_step":
                    pipe.train_step(x, y, nn.MSELoss())
                else:
                    nn.functional.mse_loss(pipe(x), y).backward()
            # Compared on the side stream itself, with no synchronisation first.
            assert_same_grads(graphed, eager)

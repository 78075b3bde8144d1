"""Pipe(compile=...): each stage's partition compiled with torch.compile.
Results equal the eager pipe, the worker adds no graph break inside a stage,
state_dict keys do not change. Backends stay cheap on the CPU (aot_eager
checks AOTAutograd's backward; inductor would take minutes on two cores)."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from mpstream import Pipe, profile
from mpstream.pipe.compiling import compile_options
from tests.helpers import assert_same_grads


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3)
    ).double()


def test_compiled_stages_equal_the_eager_pipe_without_graph_breaks() -> None:
    kwargs = {"split_size": 4, "balance": [3, 3], "devices": ["cpu"] * 2}
    eager = Pipe(model(), **kwargs)  # type: ignore[arg-type]
    compiled = Pipe(model(), compile={"backend": "aot_eager"}, **kwargs)  # type: ignore[arg-type]
    assert list(compiled.state_dict()) == list(model().state_dict())
    x, y = torch.randn(10, 6, dtype=torch.float64), torch.randn(10, 3, dtype=torch.float64)
    for pipe in (eager, compiled):
        pipe.checkpoint = "except_last"
        with profile(pipe):  # timing marks wrap the stage calls, outside the graphs
            pipe(x).pow(2).sum().backward()
        pipe.checkpoint, pipe.schedule = "always", "1f1b"
        pipe.train_step(x, y, nn.MSELoss())
    assert_same_grads(compiled, eager)
    for (name, a), b in zip(compiled.named_buffers(), eager.buffers()):
        torch.testing.assert_close(a, b, msg=name)
    # Recompilations (a new micro-batch shape, an input that requires grad
    # under profiling) are fine; a break inside a stage is not.
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_deferred_batch_norm_compiles_without_recompiling_per_micro_batch() -> None:
    kwargs = {"chunks": 6, "balance": [2, 4], "devices": ["cpu"] * 2, "deferred_batch_norm": True}
    eager = Pipe(model(), **kwargs)  # type: ignore[arg-type]
    compiled = Pipe(model(), compile={"backend": "eager"}, **kwargs)  # type: ignore[arg-type]
    for _ in range(2):
        x = torch.randn(12, 6, dtype=torch.float64)
        eager(x).sum().backward()
        compiled(x).sum().backward()
    assert_same_grads(compiled, eager)
    for (name, a), b in zip(compiled.named_buffers(), eager.buffers()):
        torch.testing.assert_close(a, b, msg=name)
    # Its statistics bookkeeping runs eagerly (one break), not once per graph
    # per micro-batch count.
    assert counters["stats"]["unique_graphs"] <= 3


def test_compile_option_is_checked_at_construction() -> None:
    assert compile_options(False) is None and compile_options(None) is None
    assert compile_options(True) is not None
    copied = compile_options({"backend": "eager"})
    assert copied is not None and copied["backend"] == "eager"
    seq = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="compile must be a bool or a dict"):
        Pipe(seq, compile="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        Pipe(seq, compile={"bogus": 1})
    with pytest.raises(RuntimeError, match="Invalid backend"):
        Pipe(seq, compile={"backend": "no_such_backend"})
    # An empty dict compiles with the defaults: refused with graphs as True is.
    with pytest.raises(ValueError, match="graphs=True and compile= both take over"):
        Pipe(seq, compile={}, graphs=True)


def test_a_compiled_pipe_copies_and_pickles() -> None:
    pipe = Pipe(model(), compile={"backend": "eager"}, balance=[3, 3], devices=["cpu"] * 2)
    x = torch.randn(4, 6, dtype=torch.float64)
    out = pipe(x)
    twin = copy.deepcopy(pipe)
    torch.testing.assert_close(twin(x), out)


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_compiled_stages_under_a_split_backward_equal_the_eager_pipe(checkpoint: str) -> None:
    # zb_h1's B computes a compiled stage's parameter gradients itself (its
    # backward is one opaque Function), so it keeps no graph for W: AOTAutograd
    # refuses retain_graph once its backward has donated buffers (micro-batches
    # of two sizes, here 4, 4 and 2).
    kwargs = {"split_size": 4, "balance": [3, 3], "devices": ["cpu"] * 2, "schedule": "zb_h1"}
    eager = Pipe(model(), checkpoint=checkpoint, **kwargs)  # type: ignore[arg-type]
    compiled = Pipe(model(), checkpoint=checkpoint, compile={"backend": "aot_eager"}, **kwargs)  # type: ignore[arg-type]
    x, y = torch.randn(10, 6, dtype=torch.float64), torch.randn(10, 3, dtype=torch.float64)
    for pipe in (eager, compiled):
        pipe(x).pow(2).sum().backward()
        for _ in range(2):
            pipe.train_step(x, y, nn.MSELoss())
    assert_same_grads(compiled, eager)


def test_a_graph_break_leaves_eager_layers_behind_a_compiled_backward() -> None:
    # DeferredBatchNorm breaks the compiled graph: eager layers whose weight
    # gradients W could defer sit behind a compiled backward on the input
    # path, which refuses the kept graph; B then computes them itself.
    def build(**kw: object) -> Pipe:
        torch.manual_seed(0)
        layers = nn.Sequential(
            nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh(),
            nn.Linear(4, 2),
        ).double()  # fmt: skip
        return Pipe(
            layers, chunks=2, balance=[2, 4], devices=["cpu"] * 2, schedule="zb_h1",
            checkpoint="except_last", deferred_batch_norm=True, **kw,  # type: ignore[arg-type]
        )  # fmt: skip

    eager, compiled = build(), build(compile={"backend": "aot_eager"})
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    for pipe in (eager, compiled):
        pipe.train_step(x, y, nn.MSELoss())
    assert_same_grads(compiled, eager)


def test_fullgraph_with_deferred_norms_is_refused_at_construction() -> None:
    # Dynamo's own error, at the first call, named mpstream's disabled
    # accumulation as the code to change.
    model = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    # The advice is the way out: the pipe was asked for deferred norms.
    with pytest.raises(ValueError, match=r"cannot hold deferred BatchNorm.*=False\)$"):
        Pipe(model, chunks=2, balance=[2, 1], devices=["cpu"] * 2,
             deferred_batch_norm=True, compile={"fullgraph": True})  # fmt: skip
    assert type(model[1]) is nn.BatchNorm1d  # the caller's model as it was


def test_deferred_norms_keep_out_of_compile_however_made_and_import_needs_no_dynamo() -> None:
    # torch.compiler.disable imports torch._dynamo (seconds): applied when a
    # norm is first made or loaded, so `import mpstream` (each CLI command)
    # does without it, and a norm loaded in a fresh process still runs its
    # bookkeeping eagerly.
    pipe = Pipe(model(), chunks=2, balance=[2, 4], devices=["cpu"] * 2, deferred_batch_norm=True)
    code = (
        "import pickle, sys, mpstream\n"
        "from mpstream.memory import batchnorm\n"
        "print('torch._dynamo' in sys.modules, batchnorm._eager)\n"
        "pickle.loads(sys.stdin.buffer.read())\n"
        "print(batchnorm._eager)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], input=pickle.dumps(pipe), capture_output=True, check=True
    )
    assert done.stdout.decode().split() == ["False", "False", "True"]

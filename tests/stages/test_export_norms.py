"""BatchNorm split by torch.export: an aten operator on the stage's own
buffers, which updates its statistics once per micro-batch (a checkpointed
stage's recomputation leaves them as they were), refuses one value per
channel as eager BatchNorm does, and keeps that check when pickled."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import Tensor, nn

from mpstream import Pipe


class Normed(nn.Module):
    """BatchNorm exported: an aten operator on the stage's own buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        self.b = nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))  # type: ignore[no-any-return]


def exported_norm(checkpoint: str, chunks: int, split: str = "b") -> Pipe:
    sample = torch.randn(4, 2, dtype=torch.float64)
    return Pipe(Normed().double(), chunks=chunks, split_points=[split], devices=["cpu"] * 2,
                checkpoint=checkpoint, tracer="export", sample=sample)  # fmt: skip


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_an_exported_batch_norm_updates_its_statistics_once(checkpoint: str) -> None:
    # The recomputation of a checkpointed stage must leave them as they were.
    pipe = exported_norm(checkpoint, chunks=1)
    ref = copy.deepcopy(pipe.a).train()
    x = torch.randn(4, 2, dtype=torch.float64)
    pipe(x).sum().backward()
    ref(x)
    for name, buffer in ref.named_buffers():
        torch.testing.assert_close(pipe.a.get_buffer(name), buffer, msg=name)


@pytest.mark.parametrize("split", ["b", "a.1"])  # a norm inside a stage, or beginning one
def test_an_exported_batch_norm_refuses_one_value_per_channel(split: str) -> None:
    # Eager BatchNorm refuses it in Python; the aten operator would give NaN.
    pipe = exported_norm("never", chunks=4, split=split)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        pipe(torch.randn(4, 2, dtype=torch.float64))
    pipe.eval()
    assert pipe(torch.randn(1, 2, dtype=torch.float64)).shape == (1, 2)


def test_an_exported_batch_norm_pipe_pickles_with_its_check() -> None:
    # Loading a stage traces its code again, the inserted check included.
    pipe = exported_norm("never", chunks=2)
    x = torch.randn(4, 2, dtype=torch.float64)
    pipe(x)
    loaded = pickle.loads(pickle.dumps(pipe))
    torch.testing.assert_close(loaded(x), pipe(x))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        loaded(torch.randn(2, 2, dtype=torch.float64))

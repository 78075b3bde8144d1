"""Models that are not chains: a GPT-style decoder, a U-Net, a fan-out; and a
stage that fails once, for the failure tests."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP, each
    in a residual branch."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    """Embedding, ``depth`` blocks, a head tied to the embedding."""

    def __init__(self, vocab: int = 11, width: int = 16, depth: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(32, width) * 0.1)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(2, c_out), nn.SiLU())


class UNet(nn.Module):
    """Two levels down, two up; the long skips cross three stages when split
    at ``down2``, ``mid`` and ``up2``."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.down1 = conv(1, width)
        self.down2 = conv(width, 2 * width)
        self.mid = conv(2 * width, 2 * width)
        self.up2 = conv(4 * width, width)
        self.up1 = conv(2 * width, width)
        self.out = nn.Conv2d(width, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        d1 = self.down1(x)
        d2 = self.down2(F.avg_pool2d(d1, 2))
        m = self.mid(F.avg_pool2d(d2, 2))
        u2 = self.up2(torch.cat([F.interpolate(m, scale_factor=2.0), d2], dim=1))
        u1 = self.up1(torch.cat([F.interpolate(u2, scale_factor=2.0), d1], dim=1))
        return self.out(u1)


class Fan(nn.Module):
    """One value (``h``) read by three later stages; a plain-value input."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor, scale: float = 1.0) -> Tensor:
        h = torch.tanh(self.embed(x))
        u = torch.tanh(self.a(h))
        v = torch.tanh(self.b(u) + h)
        w = torch.tanh(self.c(v) * h)
        return self.head(w + h) * scale


class FailOnce(nn.Module):
    """Raises ``error`` (default ``RuntimeError("stage failed")``) on its
    ``at``-th call, once; passes its input on otherwise."""

    def __init__(self, at: int, error: Exception | None = None) -> None:
        super().__init__()
        self.calls, self.at = 0, at
        self.error = error or RuntimeError("stage failed")

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return x

"""A decoder-only transformer, the workload people pipeline on one machine.

Llama-style: token embedding, pre-norm blocks of grouped-query causal
attention (rotary positions, ``scaled_dot_product_attention``) and a SwiGLU
MLP, each with RMSNorm, then a final norm and an untied head. Built as an
``nn.Sequential`` of ``[embedding, *blocks, head]``, so a
:class:`~mpstream.Pipe` splits it by layers like the tutorial's models, and
the naive model-parallel baseline runs the same split on the default stream
(:class:`NaiveParallel`). :data:`PRESETS` size it: ``tiny`` for the CPU
(tests, ``--quick``), ``1b`` (a 1B-class model) and ``3b`` (about 128 GiB
with AdamW's state and activations, estimated: it may not fit on one H200)
for a GPU, trained in
bf16 under autocast with float32 weights and AdamW state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .._words import count_of
from ..stages import check_positive

__all__ = [
    "Preset",
    "PRESETS",
    "preset",
    "decoder",
    "DecoderBlock",
    "Embedding",
    "Head",
    "NaiveParallel",
    "loss_fn",
    "tokens",
    "seeded",
    "halves",
    "flops_per_token",
    "param_count",
]


@dataclass(frozen=True)
class Preset:
    """A transformer's size and how it trains.

    Attributes:
        name: how ``--preset`` calls it.
        vocab, width, depth, heads, kv_heads, hidden: the model: vocabulary,
            model width, blocks, attention heads, key/value heads (grouped
            query attention), the SwiGLU MLP's hidden width.
        seq: tokens per sequence.
        batch: sequences per step.
        micro_batches: the micro-batch counts the bench compares.
        dtype: autocast's dtype (None: float32 throughout, on the CPU).
        repeat, warmup: timed and untimed steps per configuration.
    """

    name: str
    vocab: int
    width: int
    depth: int
    heads: int
    kv_heads: int
    hidden: int
    seq: int
    batch: int
    micro_batches: tuple[int, ...]
    dtype: torch.dtype | None
    repeat: int = 10
    warmup: int = 3

    @property
    def tokens(self) -> int:
        """Tokens per step."""
        return self.seq * self.batch


PRESETS = {
    p.name: p
    for p in (
        Preset("tiny", 256, 64, 4, 4, 2, 176, 32, 8, (2, 4), None, repeat=5, warmup=2),
        Preset("1b", 32000, 2048, 16, 32, 8, 8192, 2048, 8, (2, 4, 8), torch.bfloat16, 6, 2),
        Preset("3b", 32000, 3072, 28, 24, 8, 8192, 2048, 8, (2, 4, 8), torch.bfloat16, 6, 2),
    )
}


def preset(name: str, **changes: Any) -> Preset:
    """A preset by name, with fields changed (``batch=16``).

    Raises:
        ValueError: an unknown name, or sizes that cannot work (below 1,
            or not fitting each other).
        TypeError: a size that is not an int.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown transformer preset {name!r}; valid: {', '.join(PRESETS)}")
    p = replace(PRESETS[name], **changes)
    sizes = ("vocab", "width", "depth", "heads", "kv_heads", "hidden", "seq", "batch", "repeat")
    for size in sizes:
        try:
            check_positive(size, getattr(p, size))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"preset {p.name}: {exc}") from None
    if p.width % p.heads or p.heads % p.kv_heads or (p.width // p.heads) % 2:
        raise ValueError(
            f"preset {p.name}: width {p.width} must split into {p.heads} heads of an even "
            f"size, and the heads into {p.kv_heads} key/value groups"
        )
    if not p.micro_batches or min(p.micro_batches) < 1 or max(p.micro_batches) > p.batch:
        raise ValueError(
            f"preset {p.name}: micro-batch counts {p.micro_batches} must lie in 1..{p.batch} "
            f"(the batch, in sequences): give counts up to {p.batch} (micro_batches=, "
            f"--micro-batches) or a larger batch (batch=, --sequences)"
        )
    return p


def _rotary(seq: int, dim: int, theta: float = 10000.0) -> tuple[Tensor, Tensor]:
    """Rotary embedding tables: cos and sin per position and frequency."""
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotates each head's halves by their positions' angles."""
    a, b = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class DecoderBlock(nn.Module):
    """A pre-norm block: causal grouped-query attention, then a SwiGLU MLP."""

    def __init__(self, p: Preset) -> None:
        super().__init__()
        self.heads, self.kv_heads = p.heads, p.kv_heads
        self.head_dim = p.width // p.heads
        kv = p.kv_heads * self.head_dim
        self.attn_norm = nn.RMSNorm(p.width, eps=1e-5)
        self.q = nn.Linear(p.width, p.width, bias=False)
        self.k = nn.Linear(p.width, kv, bias=False)
        self.v = nn.Linear(p.width, kv, bias=False)
        self.o = nn.Linear(p.width, p.width, bias=False)
        self.mlp_norm = nn.RMSNorm(p.width, eps=1e-5)
        self.gate = nn.Linear(p.width, p.hidden, bias=False)
        self.up = nn.Linear(p.width, p.hidden, bias=False)
        self.down = nn.Linear(p.hidden, p.width, bias=False)
        cos, sin = _rotary(p.seq, self.head_dim // 2 * 2)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[:t], self.sin[:t]  # type: ignore[index]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, c))
        h = self.mlp_norm(x)
        out: Tensor = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return out


class Embedding(nn.Module):
    """Token ids to vectors (the first layer)."""

    def __init__(self, p: Preset) -> None:
        super().__init__()
        self.tokens = nn.Embedding(p.vocab, p.width)
        nn.init.normal_(self.tokens.weight, std=0.02)

    def forward(self, ids: Tensor) -> Tensor:
        out: Tensor = self.tokens(ids)
        return out


class Head(nn.Module):
    """The final norm and the projection to the vocabulary (the last layer)."""

    def __init__(self, p: Preset) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(p.width, eps=1e-5)
        self.out = nn.Linear(p.width, p.vocab, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.norm(x))  # type: ignore[no-any-return]


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Draws from ``seed`` (the CPU's and every GPU's generator) without
    moving the caller's random streams: they are put back afterwards."""
    gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=gpus):
        torch.manual_seed(seed)
        yield


def decoder(p: Preset, device: torch.device | str = "cpu", seed: int = 0) -> nn.Sequential:
    """The model of preset ``p`` as ``[embedding, *blocks, head]``, made
    and its weights drawn from ``seed`` on ``device`` itself.

    The same ``seed`` makes the same model on every call on one kind of
    device; a GPU's generator draws other weights than the CPU's (for the
    CPU's on a GPU: ``decoder(p).to(device)``). Drawn on the CPU, whose
    random fills run on one thread, 1b's 1.1B parameters take 5-10 s, for
    each of the bench's fifteen configurations.

    Raises:
        TypeError: ``p`` is not a :class:`Preset` (a preset's name: give
            ``preset(name)``).
    """
    if not isinstance(p, Preset):
        hint = f": use decoder(preset({p!r}))" if isinstance(p, str) else ""
        raise TypeError(f"decoder takes a Preset, got {type(p).__name__} {p!r}{hint}")
    with seeded(seed), torch.device(device):
        layers = [Embedding(p), *(DecoderBlock(p) for _ in range(p.depth)), Head(p)]
        return nn.Sequential(*layers)


def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
    """Next-token cross entropy, averaged over every token (so a batch's
    loss is the mean of its micro-batches' weighted by their tokens), in
    float32 at least (autocast's bf16 logits are upcast, float64 kept)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.flatten(0, 1).to(dtype), target.flatten())


def tokens(p: Preset, device: torch.device | str = "cpu", seed: int = 0) -> tuple[Tensor, Tensor]:
    """A batch of random token ids and its next-token targets."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, p.vocab, (p.batch, p.seq + 1), generator=g)
    return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)


def halves(p: Preset, stages: int = 2) -> list[int]:
    """Layers per stage: the blocks split evenly, the embedding with the
    first stage and the head with the last."""
    # divmod would raise ZeroDivisionError for 0 and range() a raw TypeError.
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive int, got {stages!r}")
    base, extra = divmod(p.depth, stages)
    blocks = [base + (1 if s < extra else 0) for s in range(stages)]
    blocks[0] += 1
    blocks[-1] += 1
    if min(blocks) < 1:
        raise ValueError(f"{count_of(p.depth, 'block')} cannot make {stages} stages")
    return blocks


class NaiveParallel(nn.Module):
    """Naive model parallelism: the same split, the whole batch, one device
    busy at a time, the default stream (what ``device_map`` dispatch does).

    Args:
        model: the ``nn.Sequential`` to split.
        balance: layers per stage.
        devices: a device per stage (the layers are moved there).
    """

    def __init__(
        self, model: nn.Sequential, balance: list[int], devices: list[torch.device]
    ) -> None:
        super().__init__()
        layers, self.devices = list(model), list(devices)
        self.parts = nn.ModuleList()
        start = 0
        for n, d in zip(balance, devices):
            self.parts.append(nn.Sequential(*layers[start : start + n]).to(d))
            start += n

    def forward(self, x: Tensor) -> Tensor:
        for part, device in zip(self.parts, self.devices):
            x = part(x.to(device))
        return x


def param_count(p: Preset, embedding: bool = True) -> int:
    """Parameters of preset ``p``'s model (the embedding table's or not)."""
    kv = p.kv_heads * (p.width // p.heads)
    block = 2 * p.width * p.width + 2 * p.width * kv + 3 * p.width * p.hidden + 2 * p.width
    table = p.vocab * p.width
    return p.depth * block + p.width + table + (table if embedding else 0)


def flops_per_token(p: Preset) -> float:
    """Training FLOPs per token: 6 per parameter but the embedding's (its
    lookup multiplies nothing; the norms' weights, counted too, are under
    0.3% of them), plus causal attention's scores and
    values, 6 x 2 x depth x seq x width halved by the mask."""
    matmuls = 6 * param_count(p, embedding=False)
    attention = 6 * 2 * p.depth * p.seq * p.width / 2
    return float(matmuls + attention)

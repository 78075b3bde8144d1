"""Train a small GPT-style decoder pipelined over 4 stages, split by name.

    python examples/transformer.py                          # CPU, or 4 stages on cuda:0
    python examples/transformer.py --devices cuda:0,cuda:0,cuda:1,cuda:1 --steps 50

The model is an ordinary ``nn.Module`` (embedding, pre-norm blocks with
causal attention in residual branches, a head tied to the embedding): no
``nn.Sequential`` rewrite. ``split_points`` names the blocks where stages
begin; ``torch.fx`` traces the forward and splits it there. The tied head
and embedding must share a device (the first and last stages here), which
``Pipe`` checks. Each step is a 1F1B ``train_step`` with checkpointing;
the loss is checked against the unsplit model on the first step.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import mpstream
from mpstream.cli.argtypes import devices_here, positive_int


class Block(nn.Module):
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


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = "cuda:0" if torch.cuda.is_available() else "cpu"
    p.add_argument(
        "--devices",
        type=devices_here,
        default=",".join([default] * 4),
        help="4 comma-separated devices (default: %(default)s)",
    )
    p.add_argument(
        "--steps", type=positive_int, default=20, help="training steps (default: %(default)s)"
    )
    p.add_argument(
        "--batch-size",
        "--batch",
        type=positive_int,
        default=16,
        help="sequences per step (default: %(default)s)",
    )
    p.add_argument(
        "--chunks",
        type=positive_int,
        default=4,
        help="micro-batches per step (default: %(default)s)",
    )
    p.add_argument(
        "--context",
        type=positive_int,
        default=32,
        help="tokens per sequence (default: %(default)s)",
    )
    p.add_argument(
        "--width",
        type=positive_int,
        default=64,
        help="model width, a multiple of 4 (default: %(default)s)",
    )
    args = p.parse_args()
    devices = args.devices
    if len(devices) != 4 or devices[0] != devices[-1]:
        p.error("give 4 devices; the first and last must match (they share the tied weights)")
    if args.width % 4:
        p.error(f"--width {args.width}: must divide by the 4 attention heads")

    torch.manual_seed(0)
    vocab = 97
    model = GPT(vocab, args.width, depth=8, heads=4, context=args.context)
    reference = copy.deepcopy(model)
    pipe = mpstream.Pipe(
        model,
        chunks=args.chunks,
        split_points=["blocks.2", "blocks.4", "blocks.6"],
        devices=devices,
        schedule="1f1b",
        checkpoint="except_last",
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)

    def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    for step in range(args.steps):
        # A learnable toy task: each token is the previous one plus 1.
        start = torch.randint(0, vocab, (args.batch_size, 1))
        ids = (start + torch.arange(args.context + 1)) % vocab
        inputs, target = ids[:, :-1], ids[:, 1:]
        optimizer.zero_grad()
        loss = pipe.train_step(inputs, target, loss_fn)
        if step == 0:
            expected = loss_fn(reference(inputs), target)
            torch.testing.assert_close(loss.cpu(), expected.detach(), rtol=1e-4, atol=1e-5)
            print(f"step   1  loss {loss.item():.4f} equals the unsplit model's")
        optimizer.step()
        if (step + 1) % 5 == 0 or step + 1 == args.steps:
            print(f"step {step + 1:3d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()

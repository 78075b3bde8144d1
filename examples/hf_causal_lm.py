"""Train a Hugging Face causal language model pipelined over two devices.

    python examples/hf_causal_lm.py                   # two GPUs if present, else the CPU
    python examples/hf_causal_lm.py --devices cuda:0,cuda:1 --steps 50
    python examples/hf_causal_lm.py --train-step --schedule 1f1b --checkpoint except_last

The model is ``transformers``' ``LlamaForCausalLM`` (grouped-query
attention, rotary embeddings) built from a small config: no weights, no
network. ``Pipe`` splits it with ``torch.export`` where each listed device
begins a stage (one stage per device, at evenly spaced decoder layers) and
the training loop is the usual Hugging Face one: ``pipe(**batch).loss``,
``backward()``, ``optimizer.step()`` (with ``--train-step``,
``pipe.train_step(batch)`` runs each step in the order of ``--schedule``
instead). An unsplit copy trains alongside on
the same batches; every step's loss must equal its loss (asserted), which
holds although the micro-batches hold different numbers of label tokens
(some are padding, ``-100``).
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

import mpstream
from mpstream.cli.argtypes import devices_here, positive_int


def default_devices() -> str:
    count = torch.cuda.device_count()
    if count >= 2:
        return "cuda:0,cuda:1"
    return "cuda:0,cuda:0" if count == 1 else "cpu,cpu"


def batch_of(size: int, context: int, vocab: int) -> dict[str, torch.Tensor]:
    """A learnable toy task (each token is the previous one plus 1), right-padded."""
    start = torch.randint(0, vocab, (size, 1))
    ids = (start + torch.arange(context)) % vocab
    # Two tokens at least: a sequence of one has no next token, and a batch
    # of such sequences a NaN loss.
    lengths = torch.randint(max(2, context // 2), context + 1, (size,))
    mask = (torch.arange(context) < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--devices",
        type=devices_here,
        default=default_devices(),
        help="comma-separated, one per stage (default: %(default)s)",
    )
    p.add_argument(
        "--steps", type=positive_int, default=10, help="training steps (default: %(default)s)"
    )
    p.add_argument(
        "--batch-size",
        "--batch",
        type=positive_int,
        default=8,
        help="sequences per step (default: %(default)s)",
    )
    p.add_argument(
        "--chunks",
        type=positive_int,
        default=3,
        help="micro-batches per step (default: %(default)s)",
    )
    p.add_argument(
        "--context",
        type=positive_int,
        default=16,
        help="tokens per sequence (default: %(default)s)",
    )
    p.add_argument(
        "--width",
        type=positive_int,
        default=64,
        help="hidden size, a multiple of 4 (default: %(default)s)",
    )
    p.add_argument(
        "--layers", type=positive_int, default=4, help="decoder layers (default: %(default)s)"
    )
    p.add_argument("--train-step", action="store_true", help="pipe.train_step(batch) per step")
    p.add_argument(
        "--schedule",
        default="1f1b",
        choices=["gpipe", "1f1b", "zb_h1"],
        help="train_step's order (default: %(default)s)",
    )
    p.add_argument(
        "--checkpoint",
        default="never",
        choices=["never", "except_last", "always"],
        help="Pipe's checkpoint= (default: %(default)s)",
    )
    args = p.parse_args()
    devices = args.devices
    if not 2 <= len(devices) <= args.layers:
        p.error(f"give between 2 and --layers ({args.layers}) devices")
    if args.width % 4:
        p.error(f"--width {args.width}: must divide by the 4 attention heads")
    if args.context < 2:
        p.error(f"--context {args.context}: at least 2 (each token predicts the next)")
    logging.set_verbosity_error()

    torch.manual_seed(0)
    vocab = 97
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.width,
        intermediate_size=2 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.context,
    )
    model = LlamaForCausalLM(config)
    reference = copy.deepcopy(model).to(devices[-1])
    stages = len(devices)
    points = [f"model.layers.{args.layers * s // stages}" for s in range(1, stages)]
    pipe = mpstream.Pipe(
        model,
        chunks=args.chunks,
        split_points=points,
        devices=devices,
        schedule=args.schedule,
        checkpoint=args.checkpoint,
        sample=batch_of(args.batch_size, args.context, vocab),
    )
    print(pipe.split_report())
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)

    for step in range(args.steps):
        batch = batch_of(args.batch_size, args.context, vocab)
        optimizer.zero_grad()
        if args.train_step:
            loss = pipe.train_step(batch)  # forward and backward of every micro-batch
        else:
            loss = pipe(**batch).loss
            loss.backward()
        optimizer.step()

        reference_optimizer.zero_grad()
        expected = reference(**{k: v.to(devices[-1]) for k, v in batch.items()}).loss
        expected.backward()
        reference_optimizer.step()
        torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-4, atol=1e-5)
        if step == 0:
            print(f"step   1  loss {loss.item():.4f} equals the unsplit model's")
        if (step + 1) % 5 == 0 or step + 1 == args.steps:
            print(f"step {step + 1:3d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()

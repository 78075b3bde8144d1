"""Train a small U-Net pipelined over 4 stages; its skips go straight to the stages that read them.

    python examples/unet.py                                  # CPU, or 4 stages on cuda:0
    python examples/unet.py --devices cuda:0,cuda:0,cuda:1,cuda:1 --steps 50

``split_points`` begins stages at ``down2``, ``mid`` and ``up2``. The first
encoder level's output is read only by the last decoder level, so it moves
from stage 0 to stage 3 in one copy (when they sit on different devices),
never through the stages in between; its gradient comes back the same way.
``Pipe.graph.reads()`` prints which stage reads which. The task: denoise
random shapes.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import mpstream
from mpstream.cli.argtypes import devices_here, positive_int


def block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(4, c_out), nn.SiLU(),
        nn.Conv2d(c_out, c_out, 3, padding=1), nn.GroupNorm(4, c_out), nn.SiLU(),
    )  # fmt: skip


class UNet(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.down1 = block(1, width)
        self.down2 = block(width, 2 * width)
        self.mid = block(2 * width, 4 * width)
        self.up2 = block(6 * width, 2 * width)
        self.up1 = block(3 * width, width)
        self.out = nn.Conv2d(width, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        d1 = self.down1(x)
        d2 = self.down2(F.max_pool2d(d1, 2))
        m = self.mid(F.max_pool2d(d2, 2))
        u2 = self.up2(torch.cat([F.interpolate(m, scale_factor=2.0), d2], dim=1))
        u1 = self.up1(torch.cat([F.interpolate(u2, scale_factor=2.0), d1], dim=1))
        return self.out(u1)


def shapes(batch: int, size: int) -> Tensor:
    """Random filled rectangles."""
    images = torch.zeros(batch, 1, size, size)
    for img in images:
        x0, y0 = torch.randint(0, size // 2, (2,)).tolist()
        w, h = torch.randint(size // 4, size // 2, (2,)).tolist()
        img[0, y0 : y0 + h, x0 : x0 + w] = 1.0
    return images


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
        help="images per step (default: %(default)s)",
    )
    p.add_argument(
        "--image-size",
        "--size",
        type=positive_int,
        default=32,
        help="image side, a multiple of 4 (default: %(default)s)",
    )
    p.add_argument(
        "--split-size",
        type=positive_int,
        default=4,
        help="images per micro-batch (default: %(default)s)",
    )
    p.add_argument(
        "--width",
        type=positive_int,
        default=8,
        help="channels of the first level, a multiple of 4 (default: %(default)s)",
    )
    args = p.parse_args()
    if len(args.devices) != 4:
        p.error(f"--devices: give 4 devices (one per stage), got {len(args.devices)}")
    if args.image_size % 4:
        p.error(f"--image-size {args.image_size}: must divide by 4 (the U-Net pools twice)")
    if args.width % 4:
        p.error(f"--width {args.width}: must divide by 4 (GroupNorm's 4 groups)")

    torch.manual_seed(0)
    model = UNet(args.width)
    reference = copy.deepcopy(model)
    pipe = mpstream.Pipe(
        model,
        split_size=args.split_size,
        split_points=["down2", "mid", "up2"],
        devices=args.devices,
    )
    print("stage reads:", pipe.graph.reads())
    optimizer = torch.optim.Adam(pipe.parameters(), lr=2e-3)
    for step in range(args.steps):
        clean = shapes(args.batch_size, args.image_size)
        noisy = clean + 0.3 * torch.randn_like(clean)
        optimizer.zero_grad()
        loss = pipe.train_step(noisy, clean, nn.MSELoss())
        if step == 0:
            expected = nn.MSELoss()(reference(noisy), clean)
            torch.testing.assert_close(loss.cpu(), expected.detach(), rtol=1e-4, atol=1e-6)
            print(f"step   1  loss {loss.item():.4f} equals the unsplit model's")
        optimizer.step()
        if (step + 1) % 5 == 0 or step + 1 == args.steps:
            print(f"step {step + 1:3d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()

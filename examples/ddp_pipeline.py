"""Data-parallel training of pipelined ResNet50s: one mpstream pipeline per process.

    # one machine, 2 processes (CPU, or GPUs as below)
    torchrun --standalone --nproc_per_node=2 examples/ddp_pipeline.py --stages 2
    # two machines with 4 GPUs each: 2 processes per machine, 2 GPUs per process
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST0:29500 examples/ddp_pipeline.py --stages 2
    # resume from the checkpoint the previous run saved
    torchrun --standalone --nproc_per_node=2 examples/ddp_pipeline.py --stages 2 \\
        --epochs 2 --resume

Each process builds torchvision's ResNet50 as a ``--stages``-stage
``mpstream.Pipe`` on its own devices and wraps it with
``mpstream.distributed.wrap`` (DistributedDataParallel with
``device_ids=None``). The process with local rank ``r`` takes GPUs
``r*d .. r*d+d-1`` (``d`` = ``--devices-per-process``; by default ``--stages``
when the machine has that many GPUs per process, else 1), stage ``s`` on GPU
``r*d + s*d // stages``; without enough GPUs every stage runs on the CPU.
NCCL reduces CUDA gradients, gloo CPU ones.

The data is a fixed synthetic set of random images with random integer labels
(CrossEntropyLoss), split between processes by a DistributedSampler. After
every epoch rank 0 saves the model, optimizer and epoch to ``--ckpt``; with
``--resume`` every process loads it onto its own stage devices.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchvision.models import resnet50

import mpstream
from mpstream import distributed as mpdist
from mpstream.cli.argtypes import positive_float, positive_int
from mpstream.cli.resnet import RESNET50_LAYERS
from mpstream.schedules import PLACEMENTS
from mpstream.stages import partition
from mpstream.tutorial import resnet50_layers


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--stages",
        type=positive_int,
        default=2,
        help="pipeline stages per process (default: %(default)s)",
    )
    p.add_argument(
        "--devices-per-process",
        type=positive_int,
        help="GPUs per process (default: --stages if there are enough, else 1)",
    )
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when GPUs exist")
    p.add_argument("--balance", help="layers per stage, e.g. 11,12 (default: even split)")
    p.add_argument("--epochs", type=positive_int, default=1, help="epochs (default: %(default)s)")
    p.add_argument("--steps", type=positive_int, help="at most this many steps per epoch")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=8,
        help="images per process and step (default: %(default)s)",
    )
    p.add_argument(
        "--image-size", type=positive_int, default=64, help="image side (default: %(default)s)"
    )
    p.add_argument(
        "--num-classes", type=positive_int, default=10, help="classes (default: %(default)s)"
    )
    p.add_argument(
        "--dataset-size",
        type=positive_int,
        default=256,
        help="random images in the dataset (default: %(default)s)",
    )
    split = p.add_mutually_exclusive_group()
    split.add_argument("--split-size", type=positive_int, help="micro-batch size")
    split.add_argument("--chunks", type=positive_int, help="micro-batches per step (default 2)")
    p.add_argument(
        "--schedule",
        choices=mpstream.SCHEDULES,
        default="gpipe",
        help="the order of --train-step (default: %(default)s)",
    )
    p.add_argument(
        "--virtual-stages",
        type=positive_int,
        help="the schedules with several stages per rank (interleaved_1f1b, looped_bfs, "
        "interleaved_zb, zbv, dualpipev): stages per pipeline rank (needed when stages share "
        "a device)",
    )
    p.add_argument(
        "--checkpoint",
        choices=["never", "except_last", "always"],
        default="never",
        help="Pipe's checkpoint= (default: %(default)s)",
    )
    p.add_argument(
        "--train-step",
        action="store_true",
        help="use mpstream.distributed.train_step (runs --schedule) instead of forward+backward",
    )
    p.add_argument(
        "--ckpt",
        type=Path,
        default=Path("ddp_pipeline.pt"),
        help="checkpoint file (default: %(default)s)",
    )
    p.add_argument("--resume", action="store_true", help="start from --ckpt")
    p.add_argument(
        "--lr",
        type=positive_float,
        default=0.001,
        help="SGD's learning rate (default: %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="data and initialisation seed (default: %(default)s)"
    )
    args = p.parse_args()
    if args.devices_per_process is not None and not 1 <= args.devices_per_process <= args.stages:
        p.error("--devices-per-process must be between 1 and --stages")
    # Refused here, once, rather than by every process's Pipe after the rendezvous.
    if args.stages > RESNET50_LAYERS:
        p.error(f"--stages {args.stages}: ResNet50 has {RESNET50_LAYERS} blocks, a stage needs one")
    if args.balance is not None:
        counts = [n.strip() for n in args.balance.split(",")]
        if not all(n.isdigit() and int(n) > 0 for n in counts):
            p.error(f"--balance {args.balance}: expected layer counts, e.g. 11,12")
        if len(counts) != args.stages:
            p.error(f"--balance {args.balance}: {len(counts)} stages, but --stages {args.stages}")
        if sum(map(int, counts)) != RESNET50_LAYERS:
            p.error(f"--balance {args.balance}: must add up to ResNet50's {RESNET50_LAYERS} blocks")
    if args.split_size is None and args.chunks is None:
        args.chunks = 2
    return args


def stage_devices(
    local_rank: int, local_world_size: int, stages: int, per_process: int | None, cpu: bool
) -> list[torch.device]:
    """The devices of one process's stages (see the module docstring)."""
    gpus = 0 if cpu else torch.cuda.device_count()
    if cpu or (per_process is None and gpus < local_world_size):
        return [torch.device("cpu")] * stages
    if per_process is None:
        per_process = stages if gpus >= stages * local_world_size else 1
    if gpus < per_process * local_world_size:
        raise SystemExit(
            f"{local_world_size} processes x {per_process} GPUs each need "
            f"{local_world_size * per_process} GPUs; this machine has {gpus}"
        )
    first = local_rank * per_process
    return [torch.device("cuda", first + s * per_process // stages) for s in range(stages)]


def build_pipe(args: argparse.Namespace, devices: list[torch.device]) -> mpstream.Pipe:
    layers = resnet50_layers(resnet50(num_classes=args.num_classes))
    if args.balance:
        balance = [int(n) for n in args.balance.split(",")]
    else:
        balance = partition([1.0] * len(layers), args.stages)
    try:
        return mpstream.Pipe(
            layers,
            chunks=args.chunks,
            split_size=args.split_size,
            balance=balance,
            devices=devices,
            schedule=args.schedule,
            checkpoint=args.checkpoint,
            # One stage per rank refuses virtual_stages; the others need it on one device.
            virtual_stages=args.virtual_stages if PLACEMENTS[args.schedule] != "stage" else None,
        )
    except ValueError as error:
        if args.virtual_stages is None and "virtual_stages=" in str(error):
            # The Pipe names its own argument; this script's user sets the flag.
            raise SystemExit(
                f"--schedule {args.schedule}: {error} (this script's --virtual-stages)"
            ) from None
        raise


def synthetic_data(args: argparse.Namespace) -> TensorDataset:
    # The same seed on every process: one dataset, which the sampler splits.
    g = torch.Generator().manual_seed(args.seed)
    size = (args.dataset_size, 3, args.image_size, args.image_size)
    images = torch.randn(size, generator=g)
    labels = torch.randint(args.num_classes, (args.dataset_size,), generator=g)
    return TensorDataset(images, labels)


def mean_over_processes(loss: Tensor) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)  # SUM: gloo has no AVG
    return total.item() / dist.get_world_size()


def replicas_agree(pipe: mpstream.Pipe, device: torch.device) -> bool:
    """Whether every process holds the same parameters (compared by per-tensor sums)."""
    sums = torch.stack([p.detach().double().sum().to(device) for p in pipe.parameters()])
    gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, sums)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:
        raise SystemExit(
            f"launch with torchrun, e.g. torchrun --standalone --nproc_per_node=2 {__file__}"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    devices = stage_devices(
        local_rank, local_world, args.stages, args.devices_per_process, args.cpu
    )
    on_cuda = devices[0].type == "cuda"
    if on_cuda:
        torch.cuda.set_device(devices[0])  # NCCL's device for this process
    # env:// rendezvous: torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
    dist.init_process_group("nccl" if on_cuda else "gloo")
    rank = dist.get_rank()

    torch.manual_seed(args.seed)
    pipe = build_pipe(args, devices)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    start_epoch = 0
    if args.resume:
        # Rank 0 saved from its stage devices (every machine runs the same layout);
        # each stage's tensors load straight onto this process's device for it.
        saved = stage_devices(0, local_world, args.stages, args.devices_per_process, args.cpu)
        where = mpdist.map_location(saved, devices)
        state = torch.load(args.ckpt, map_location=where, weights_only=True)
        pipe.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"]
        if rank == 0:
            print(f"resumed from {args.ckpt} at epoch {start_epoch} (map_location {where})")
    ddp = mpdist.wrap(pipe)

    dataset = synthetic_data(args)
    # drop_last keeps every process's batch the same size, so averaging the
    # processes' mean losses gives the mean over the global batch.
    sampler: DistributedSampler[tuple[Tensor, ...]] = DistributedSampler(
        dataset, shuffle=True, seed=args.seed, drop_last=True
    )
    loader = DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True, pin_memory=on_cuda
    )
    loss_fn = nn.CrossEntropyLoss()
    if rank == 0:
        placed = ", ".join(str(d) for d in devices)
        print(
            f"{dist.get_world_size()} processes x {args.stages} stages (rank 0 on {placed}), "
            f"balance {pipe.balance}, {args.schedule}, checkpoint={args.checkpoint}, "
            f"{'train_step' if args.train_step else 'forward+backward'}"
        )

    if start_epoch >= args.epochs and rank == 0:
        print(f"nothing to do: the checkpoint has {start_epoch} epochs, --epochs is {args.epochs}")
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        pipe.train()
        started = time.perf_counter()
        for step, (images, labels) in enumerate(loader):
            if args.steps is not None and step >= args.steps:
                break
            optimizer.zero_grad(set_to_none=True)
            labels = labels.to(devices[-1], non_blocking=True)
            if args.train_step:
                loss = mpdist.train_step(ddp, images, labels, loss_fn)
            else:
                loss = loss_fn(ddp(images), labels)
                loss.backward()
            optimizer.step()
            mean = mean_over_processes(loss)
            if rank == 0:
                print(f"epoch {epoch} step {step} loss {mean:.4f}", flush=True)
        if rank == 0:
            print(f"epoch {epoch} took {time.perf_counter() - started:.1f} s")
            state = {
                "model": ddp.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch + 1,
            }
            torch.save(state, args.ckpt)
            print(f"saved {args.ckpt}")
        dist.barrier()  # nobody reads or overwrites the file before it is complete

    in_sync = replicas_agree(pipe, devices[0])
    if rank == 0:
        print(f"replicas in sync: {'yes' if in_sync else 'NO'}")
    # DDP's reducer holds the process group. Dropped last by the reducer, a
    # gloo group is destroyed holding the GIL while its worker thread may
    # still need the GIL to free a finished collective's tensors: a deadlock
    # at exit (seen with torch 2.11). Dropped last by destroy_process_group,
    # it is destroyed without the GIL.
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

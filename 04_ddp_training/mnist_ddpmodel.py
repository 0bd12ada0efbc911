"""Lesson 04: DistributedDataParallel, one process per GPU (or per CPU slot), any number of nodes.

Every process holds a full replica, trains on its own shard of the data, and DDP all_reduces
the gradients during backward, so all replicas take the same optimizer step:
    torchrun --standalone --nproc_per_node=2 mnist_ddpmodel.py --epochs 1 --data synthetic
"""
import itertools
import socket
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from common.checkpointer import Checkpointer
from common.cli import base_parser, parse, positive_int, run
from common.data import load_mnist
from common.distributed import cleanup, setup
from common.errors import CourseError
from common.loaders import make_loader
from common.log import log0, log_all, progress
from common.metrics import EpochMeter
from common.model import Net
from common.preemption import StopSignal
from common.results import RunRecorder
from common.samplers import EvalSampler

LESSON = "04_ddp_training"


def train(args, model, device, train_loader, optimizer, epoch, steps, first_step, stop):
    model.train()
    meter = EpochMeter(device)
    batches = itertools.islice(train_loader, first_step * args.grad_accum, steps * args.grad_accum)
    total = (steps - first_step) * args.grad_accum  # a resumed epoch skips what it already did
    for i, (data, target) in enumerate(progress(batches, f"epoch {epoch}", total), first_step * args.grad_accum):
        if i % args.grad_accum == 0 and stop.requested(i // args.grad_accum, device):
            return None, i // args.grad_accum  # every rank stops at the same optimizer step
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        sync_now = (i + 1) % args.grad_accum == 0
        # no_sync(): accumulate local gradients and skip the all_reduce until the last micro-batch.
        with nullcontext() if sync_now else model.no_sync():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
                output = model(data)
            loss = F.nll_loss(output.float(), target)
            (loss / args.grad_accum).backward()  # DDP all_reduces (averages) gradients here when syncing
        if sync_now:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        meter.update(loss.detach() * len(data), 0, len(data))  # a SUM, so epochs average correctly
    return meter.reduce(), steps


@torch.no_grad()
def test(args, model, device, test_loader):
    model.eval()
    meter = EpochMeter(device)
    for data, target in test_loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            output = model(data)
        loss_sum = F.nll_loss(output.float(), target, reduction="sum")
        meter.update(loss_sum, (output.argmax(dim=1) == target).sum(), len(data))
    return meter.reduce()


def main(argv=None):
    parser = base_parser(LESSON, "Lesson 04: MNIST with DistributedDataParallel (torchrun or srun)")
    parser.add_argument("--grad-accum", type=positive_int, default=1,
                        help="micro-batches per optimizer step; the all_reduce runs once per step (default: 1)")
    parser.add_argument("--sync-bn", action="store_true",
                        help="add BatchNorm and synchronise its statistics across GPUs (GPU only)")
    args = parse(parser, argv)

    ctx = setup(use_distributed="on", device=args.device)  # reads RANK/WORLD_SIZE (torchrun or srun), inits the group
    device = ctx.device  # cuda:LOCAL_RANK: the GPU is chosen by the rank WITHIN the node
    master_process = ctx.rank == 0  # rank 0 downloads, logs and saves for everyone
    world_size = ctx.world_size  # the number of processes in the job, on all nodes
    torch.manual_seed(args.seed)  # same seed everywhere: every replica starts from the same weights
    log_all(f"host {socket.gethostname()} rank {ctx.rank}/{world_size} local_rank {ctx.local_rank} "
            f"device {device} backend {ctx.backend}")
    if args.sync_bn and device.type != "cuda":
        raise CourseError("--sync-bn needs GPUs (SyncBatchNorm only works with CUDA modules): drop it on CPU")

    train_ds, test_ds = load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples,
                                   is_main=master_process, barrier=ctx.barrier)
    # Shard by GLOBAL rank: with local rank, every node would train on the same shard.
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=ctx.rank,
                                       shuffle=True, seed=args.seed)
    test_sampler = EvalSampler(test_ds, num_replicas=world_size, rank=ctx.rank)  # no padded duplicates
    train_loader = make_loader(train_ds, args.batch_size, train_sampler, device, args.num_workers, args.data_on_device)
    test_loader = make_loader(test_ds, args.test_batch_size, test_sampler, device, args.num_workers,
                              args.data_on_device)
    steps = min(len(train_loader) // args.grad_accum, args.max_steps or len(train_loader))
    if steps == 0:
        raise CourseError(f"--grad-accum {args.grad_accum} needs more batches than this rank's "
                          f"{len(train_loader)}: lower it or use more --train-samples")
    log0(f"lesson 04: {world_size} processes, {args.batch_size} images each per micro-batch, "
         f"effective batch {args.batch_size * args.grad_accum * world_size}")

    model = Net(width=args.width, batch_norm=args.sync_bn).to(device)
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # batch statistics over ALL ranks
    # DDP broadcasts rank 0's weights at construction, then all_reduces gradients in backward.
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=True)  # gradients live in the all_reduce buckets: one copy less
    if args.compile:
        model = torch.compile(model)  # fuses kernels; the first steps pay for compilation
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    # Replicas are identical, so rank 0 writes one file; the other ranks wait at a barrier inside.
    checkpointer = Checkpointer(args.output_dir, LESSON, keep=args.keep_checkpoints)
    start_epoch, first_step = checkpointer.resume(args.resume, model, optimizer, scheduler, device)
    stop = StopSignal()  # Slurm's SIGUSR1 (time limit near) or SIGTERM (preemption) -> stop at a step boundary

    recorder = RunRecorder(args.output_dir, LESSON, ctx, args, start_epoch)
    for epoch in range(start_epoch, args.epochs + 1):
        train_sampler.set_epoch(epoch)  # a new shuffle each epoch, identical on every rank
        train_stats, done = train(args, model, device, train_loader, optimizer, epoch, steps, first_step, stop)
        first_step = 0
        if train_stats is None:  # a signal: save where we are and let Slurm restart us (--resume auto)
            checkpointer.save(model, optimizer, scheduler, epoch=epoch - 1, epoch_step=done, args=args)
            stop.requeue(epoch, done)
            break
        test_stats = test(args, model, device, test_loader)
        scheduler.step()
        recorder.add_epoch(epoch, train_stats, test_stats)
        checkpointer.save(model, optimizer, scheduler, epoch=epoch, args=args)
    cleanup()
    return recorder.record  # the numbers of metrics.json, e.g. for a notebook


if __name__ == "__main__":
    run(main)

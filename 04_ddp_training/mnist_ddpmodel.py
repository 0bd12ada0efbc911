"""Lesson 04: DistributedDataParallel, one process per GPU (or per CPU slot), any number of nodes.

Every process holds a full replica, trains on its own shard of the data, and DDP all_reduces
the gradients during backward, so all replicas take the same optimizer step:
    torchrun --standalone --nproc_per_node=2 mnist_ddpmodel.py --epochs 1 --data synthetic
"""
import signal
import socket
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from common.checkpoints import CheckpointDir
from common.cli import base_parser, parse, positive_int, run
from common.data import load_mnist
from common.distributed import init_timeout, launch_env, pick_backend, pick_device, restart_safe_store
from common.errors import CourseError
from common.files import atomic_save
from common.loaders import make_loader, steps_per_epoch
from common.log import log0, log_all
from common.metrics import EpochMeter
from common.model import Net
from common.optim import make_optimizer, make_scheduler
from common.profiling import warm_up
from common.progress import Progress
from common.samplers import EvalSampler

LESSON = "04_ddp_training"


def train(args, model, device, train_loader, optimizer, scheduler, progress):
    model.train()
    batches = progress.batches(train_loader, per_step=args.grad_accum)  # skips what a restarted epoch did
    for i, (data, target) in enumerate(batches, 1):
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        sync_now = i % args.grad_accum == 0  # the last micro-batch of an optimizer step
        # no_sync(): accumulate local gradients and skip the all_reduce until the last micro-batch.
        with nullcontext() if sync_now else model.no_sync():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
                output = model(data)
            loss = F.nll_loss(output.float(), target)
            (loss / args.grad_accum).backward()  # DDP all_reduces (averages) the gradients here when syncing
        if sync_now:
            if args.clip_grad:  # the norm over ALL parameters: DDP's gradients are already averaged, the same everywhere
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()
            scheduler.step()  # the learning rate schedule advances once per optimizer step
            optimizer.zero_grad(set_to_none=True)
        progress.add_loss(loss, len(data))


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


def save_checkpoint(path, model, optimizer, scheduler, progress):
    """Everything needed to continue: weights, optimizer and schedule state, and how far training got."""
    state = {"model": model.module.state_dict(),  # .module: the plain Net inside DDP
             "optimizer": optimizer.state_dict(),  # progress.state_dict() is a collective: every rank's RNG
             "scheduler": scheduler.state_dict(), "progress": progress.state_dict()}
    if dist.get_rank() == 0:  # the replicas are identical: one file, written by rank 0
        atomic_save(state, path)  # a temporary file renamed into place: a crash never leaves half a checkpoint
    dist.barrier()  # no rank goes on (or reads it) before the file is complete


def load_checkpoint(path, model, optimizer, scheduler, progress, device):
    # Every rank reads the file; map_location puts rank 0's saved tensors on THIS rank's device.
    checkpoint = torch.load(path, map_location=device, weights_only=True)  # tensors and plain data, never code
    model.module.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    progress.load_state_dict(checkpoint["progress"])


def main(argv=None):
    parser = base_parser(LESSON, "Lesson 04: MNIST with DistributedDataParallel (torchrun or srun)")
    parser.add_argument("--grad-accum", type=positive_int, default=1,
                        help="micro-batches per optimizer step; the all_reduce runs once per step (default: 1)")
    parser.add_argument("--clip-grad", type=float, metavar="MAX_NORM", help="clip the gradients' norm (default: off)")
    parser.add_argument("--sync-bn", action="store_true",
                        help="add BatchNorm and synchronise its statistics across GPUs (GPU only)")
    args = parse(parser, argv)

    env = launch_env()  # RANK, LOCAL_RANK, WORLD_SIZE from torchrun, or from srun's SLURM_* variables
    device = pick_device(args.device, env)  # cuda:LOCAL_RANK: the GPU is chosen by the rank WITHIN the node
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this process uses this GPU, and only this one
    dist.init_process_group(backend=pick_backend(device), timeout=init_timeout(),  # meet at MASTER_ADDR:PORT
                            rank=env.rank, world_size=env.world_size, store=restart_safe_store(env),
                            device_id=device if device.type == "cuda" else None)  # binds NCCL to the GPU now
    rank, world_size = dist.get_rank(), dist.get_world_size()  # rank 0 of world_size does the writing
    log_all(f"host {socket.gethostname()} rank {rank}/{world_size} local_rank {env.local_rank} "
            f"device {device} backend {dist.get_backend()}")
    if args.sync_bn and device.type != "cuda":
        raise CourseError("--sync-bn needs GPUs (SyncBatchNorm only works with CUDA modules): drop it on CPU")
    torch.manual_seed(args.seed)  # the same seed on every rank: identical initial weights

    train_ds, test_ds = load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples,
                                   is_main=rank == 0, barrier=dist.barrier)  # rank 0 downloads, the rest wait
    # Shard by GLOBAL rank: with the local rank, every node would train on the same shard.
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    test_sampler = EvalSampler(test_ds, num_replicas=world_size, rank=rank)  # no padded duplicates
    train_loader = make_loader(train_ds, args.batch_size, train_sampler, device, args.num_workers, args.data_on_device)
    test_loader = make_loader(test_ds, args.test_batch_size, test_sampler, device, args.num_workers,
                              args.data_on_device)

    model = Net(width=args.width, batch_norm=args.sync_bn).to(device)
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # batch statistics over ALL ranks
    if args.compile:
        model = torch.compile(model)  # fuses kernels; the first steps pay for compilation
    # DDP broadcasts rank 0's weights at construction, then all_reduces gradients in backward.
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=True)  # gradients live in the all_reduce buckets: one copy less
    torch.manual_seed(args.seed + rank)  # from here on each rank its own stream: different dropout masks
    log0(f"lesson 04: {world_size} processes, {args.batch_size} images each per micro-batch, "
         f"effective batch {args.batch_size * args.grad_accum * world_size}")
    optimizer = make_optimizer(args, model.parameters(), world_size)  # --lr-scaling uses the world size
    scheduler = make_scheduler(args, optimizer, steps_per_epoch(train_loader, args))  # --schedule (default: lr x 0.7 every epoch)
    warmup_s = warm_up(model, optimizer, train_loader, device, args)  # one-off costs, timed apart, then undone
    progress = Progress(args, LESSON, device, world_size, warmup_seconds=warmup_s)
    progress.stop_on(signal.SIGUSR1, signal.SIGTERM)  # Slurm: time limit near, or preemption
    checkpoints = CheckpointDir(args.output_dir, args, LESSON)
    if (path := checkpoints.resume_from(args.resume)) is not None:  # --resume auto: the newest good checkpoint
        load_checkpoint(path, model, optimizer, scheduler, progress, device)

    for epoch in progress.epochs(args.epochs):
        train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        train(args, model, device, train_loader, optimizer, scheduler, progress)
        if progress.stopped:  # every rank agreed: save where we are, and let Slurm restart the job
            save_checkpoint(checkpoints.path(progress), model, optimizer, scheduler, progress)
            progress.requeue()
            break
        test_stats = test(args, model, device, test_loader)
        progress.end_epoch(test_stats)  # prints the epoch line, writes metrics.json and curves.png
        path = checkpoints.path(progress)
        save_checkpoint(path, model, optimizer, scheduler, progress)
        checkpoints.prune(path)  # keep the newest --keep-checkpoints
    dist.destroy_process_group()
    return progress.record  # the numbers of metrics.json, e.g. for a notebook


if __name__ == "__main__":
    run(main)

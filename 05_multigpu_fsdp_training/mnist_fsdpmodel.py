"""Lesson 05: FSDP2 (fully_shard): each process keeps only a 1/N shard of weights, grads and optimizer state.

Before a layer runs, its full weights are all-gathered; after backward, gradients are
reduce-scattered so each rank updates only its shard. Memory per GPU falls as ranks grow:
    torchrun --standalone --nproc_per_node=2 mnist_fsdpmodel.py --epochs 1 --data synthetic --width 4
"""
import itertools
import socket
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DistributedSampler

from common.checkpointer import Checkpointer
from common.cli import base_parser, parse, run
from common.dcp_checkpoint import export_full
from common.data import load_mnist
from common.distributed import cleanup, setup
from common.loaders import make_loader
from common.log import log0, log_all, progress
from common.metrics import EpochMeter
from common.model import Net, count_parameters
from common.preemption import StopSignal
from common.results import RunRecorder
from common.samplers import EvalSampler

LESSON = "05_multigpu_fsdp_training"


def train(args, model, device, train_loader, optimizer, epoch, steps, first_step, stop):
    model.train()
    meter = EpochMeter(device)
    batches = itertools.islice(train_loader, first_step, steps)  # a resumed epoch skips what it already did
    for step, (data, target) in enumerate(progress(batches, f"epoch {epoch}", steps - first_step), first_step):
        if stop.requested(step, device):  # every rank agrees, so none is left waiting in a collective
            return None, step
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            output = model(data)  # each layer all-gathers its weights, runs, frees them again
        loss = F.nll_loss(output.float(), target)
        loss.backward()  # gradients are reduce-scattered: each rank keeps the mean of its shard
        optimizer.step()  # updates only this rank's shard of weights and optimizer state
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
    parser = base_parser(LESSON, "Lesson 05: MNIST with FSDP2 (fully_shard) and sharded DCP checkpoints")
    args = parse(parser, argv)

    ctx = setup(use_distributed="on", device=args.device)  # FSDP needs a process group, even of one
    device = ctx.device  # cuda:LOCAL_RANK: the GPU is chosen by the rank WITHIN the node
    master_process = ctx.rank == 0  # rank 0 downloads, logs and saves for everyone
    world_size = ctx.world_size  # the number of processes in the job, on all nodes
    torch.manual_seed(args.seed)  # same seed everywhere: every replica starts from the same weights
    log_all(f"host {socket.gethostname()} rank {ctx.rank}/{world_size} local_rank {ctx.local_rank} "
            f"device {device} backend {ctx.backend}")

    train_ds, test_ds = load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples,
                                   is_main=master_process, barrier=ctx.barrier)
    # Shard by GLOBAL rank: with local rank, every node would train on the same shard.
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=ctx.rank,
                                       shuffle=True, seed=args.seed)
    test_sampler = EvalSampler(test_ds, num_replicas=world_size, rank=ctx.rank)  # no padded duplicates
    train_loader = make_loader(train_ds, args.batch_size, train_sampler, device, args.num_workers, args.data_on_device)
    test_loader = make_loader(test_ds, args.test_batch_size, test_sampler, device, args.num_workers,
                              args.data_on_device)
    steps = min(len(train_loader), args.max_steps or len(train_loader))

    model = Net(width=args.width).to(device)
    mesh = init_device_mesh(device.type, (world_size,))  # 1-D mesh: shard over all ranks
    # bf16 weights in forward/backward on GPUs, fp32 gradient reduction and fp32 master weights.
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)  # one all-gather unit per layer
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)  # the root: whatever is left over
    if args.compile:
        model = torch.compile(model)  # fuses kernels; the first steps pay for compilation
    log0(f"lesson 05: {world_size} processes, {count_parameters(model) / 1e6:.1f} M parameters, "
         f"each rank stores ~1/{world_size} of them")
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    # No rank holds the whole model: every rank writes its own shards (DCP), in parallel.
    checkpointer = Checkpointer(args.output_dir, LESSON, keep=args.keep_checkpoints, sharded=True)
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
    # One plain file for inference: the full weights gathered onto rank 0 (loads into a plain Net).
    export_full(Path(args.output_dir) / "model_full.pt", model, epoch=args.epochs, args=args, lesson=LESSON)
    cleanup()
    return recorder.record  # the numbers of metrics.json, e.g. for a notebook


if __name__ == "__main__":
    run(main)

"""Lesson 02: the classic MNIST CNN on ONE device: a GPU if there is one, else the CPU.

This is the baseline every later lesson changes as little as possible:
    python mnist_singlegpu.py --epochs 1 --data synthetic
"""
import itertools

import torch
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import RandomSampler, SequentialSampler

from common.checkpointer import Checkpointer
from common.cli import base_parser, parse, run
from common.data import load_mnist
from common.distributed import cleanup, setup
from common.loaders import make_loader
from common.log import log0, progress
from common.metrics import EpochMeter
from common.model import Net
from common.preemption import StopSignal
from common.profiling import profile_steps
from common.results import RunRecorder

LESSON = "02_singlegpu_training"


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
            output = model(data)
        loss = F.nll_loss(output.float(), target)
        loss.backward()
        optimizer.step()
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
    parser = base_parser(LESSON, "Lesson 02: MNIST on one GPU (or the CPU)")
    parser.add_argument("--profile", action="store_true",
                        help="profile 30 training steps with torch.profiler and print where the time goes")
    args = parse(parser, argv)
    if args.profile:
        args.epochs, args.max_steps = 1, min(args.max_steps or 30, 30)

    ctx = setup(use_distributed="off", device=args.device)  # one process, no process group
    device = ctx.device
    torch.manual_seed(args.seed)
    log0(f"lesson 02: 1 process on {device}")

    train_ds, test_ds = load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples)
    train_sampler = RandomSampler(train_ds, generator=torch.Generator())  # reseeded every epoch below
    test_sampler = SequentialSampler(test_ds)
    train_loader = make_loader(train_ds, args.batch_size, train_sampler, device, args.num_workers, args.data_on_device)
    test_loader = make_loader(test_ds, args.test_batch_size, test_sampler, device, args.num_workers,
                              args.data_on_device)
    steps = min(len(train_loader), args.max_steps or len(train_loader))

    model = Net(width=args.width).to(device)
    if args.compile:
        model = torch.compile(model)  # fuses kernels; the first steps pay for compilation
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    checkpointer = Checkpointer(args.output_dir, LESSON, keep=args.keep_checkpoints)  # rank 0 writes one file
    start_epoch, first_step = checkpointer.resume(args.resume, model, optimizer, scheduler, device)
    stop = StopSignal()  # Slurm's SIGUSR1 (time limit near) or SIGTERM (preemption) -> stop at a step boundary

    recorder = RunRecorder(args.output_dir, LESSON, ctx, args, start_epoch)
    for epoch in range(start_epoch, args.epochs + 1):
        train_sampler.generator.manual_seed(args.seed + epoch)  # a new, reproducible order each epoch
        if args.profile:
            with profile_steps(device):
                train(args, model, device, train_loader, optimizer, epoch, steps, 0, stop)
            break
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

"""Lesson 03: nn.DataParallel, one process driving every visible GPU.

Each batch is split across the GPUs, replicas of the model run the pieces in threads, and the
outputs and gradients are gathered back on GPU 0. Easy to add, slow to scale (see the README):
    python mnist_dpmodel.py --epochs 1 --data synthetic
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import RandomSampler, SequentialSampler

from common.checkpoints import CheckpointDir
from common.cli import base_parser, parse, run
from common.data import load_mnist
from common.distributed import describe_gpu_paths, pick_device
from common.files import atomic_save
from common.loaders import make_loader, steps_per_epoch
from common.log import log0
from common.metrics import EpochMeter
from common.model import Net
from common.optim import make_optimizer, make_scheduler
from common.profiling import warm_up
from common.progress import Progress

LESSON = "03_dp_training"


def train(args, model, device, train_loader, optimizer, scheduler, progress):
    model.train()
    for data, target in progress.batches(train_loader):  # a restarted epoch skips the batches it already did
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            output = model(data)
        loss = F.nll_loss(output.float(), target)
        loss.backward()
        optimizer.step()
        scheduler.step()  # the learning rate schedule advances once per optimizer step
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
    state = {"model": model.module.state_dict(),  # .module: the plain Net inside DataParallel
             "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "progress": progress.state_dict()}
    atomic_save(state, path)  # a temporary file renamed into place: a crash never leaves half a checkpoint


def load_checkpoint(path, model, optimizer, scheduler, progress, device):
    checkpoint = torch.load(path, map_location=device, weights_only=True)  # tensors and plain data, never code
    model.module.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    progress.load_state_dict(checkpoint["progress"])


def main(argv=None):
    parser = base_parser(LESSON, "Lesson 03: MNIST with nn.DataParallel over the visible GPUs")
    args = parse(parser, argv)

    device = pick_device(args.device)  # cuda if there is a GPU, else cpu
    torch.manual_seed(args.seed)
    n_gpus = torch.cuda.device_count() if device.type == "cuda" else 0

    train_ds, test_ds = load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples)
    train_sampler = RandomSampler(train_ds, generator=torch.Generator())  # reseeded every epoch below
    test_sampler = SequentialSampler(test_ds)
    train_loader = make_loader(train_ds, args.batch_size, train_sampler, device, args.num_workers, args.data_on_device)
    test_loader = make_loader(test_ds, args.test_batch_size, test_sampler, device, args.num_workers,
                              args.data_on_device)

    model = Net(width=args.width).to(device)  # the master copy lives on GPU 0 (cuda:0)
    if args.compile:
        model = torch.compile(model)  # fuses kernels; the first steps pay for compilation
    model = nn.DataParallel(model)  # --batch-size is split across the GPUs at every step (on CPU: a no-op)
    torch.backends.cudnn.benchmark = False  # DP's threads are new at every step; cuDNN autotunes per thread
    if n_gpus > 1:
        log0(f"lesson 03: 1 process, nn.DataParallel over {n_gpus} GPUs, {args.batch_size // n_gpus} images per GPU")
        log0(describe_gpu_paths(n_gpus))  # DataParallel copies to and from GPU 0 at every step
    else:
        log0(f"lesson 03: DataParallel needs 2+ GPUs and does nothing on {device}: running as one process")
    optimizer = make_optimizer(args, model.parameters())  # --optimizer, --lr (default: Adadelta, lr 1.0)
    scheduler = make_scheduler(args, optimizer, steps_per_epoch(train_loader, args))  # --schedule (default: lr x 0.7 every epoch)
    warmup_s = warm_up(model, optimizer, train_loader, device, args)  # one-off costs, timed apart, then undone
    progress = Progress(args, LESSON, device, warmup_seconds=warmup_s)
    checkpoints = CheckpointDir(args.output_dir, args, LESSON)
    if (path := checkpoints.resume_from(args.resume)) is not None:  # --resume auto: the newest good checkpoint
        load_checkpoint(path, model, optimizer, scheduler, progress, device)

    for epoch in progress.epochs(args.epochs):
        train_sampler.generator.manual_seed(args.seed + epoch)  # a new, reproducible order each epoch
        train(args, model, device, train_loader, optimizer, scheduler, progress)
        test_stats = test(args, model, device, test_loader)
        progress.end_epoch(test_stats)  # prints the epoch line, writes metrics.json and curves.png
        path = checkpoints.path(progress)
        save_checkpoint(path, model, optimizer, scheduler, progress)
        checkpoints.prune(path)  # keep the newest --keep-checkpoints
    return progress.record  # the numbers of metrics.json, e.g. for a notebook


if __name__ == "__main__":
    run(main)

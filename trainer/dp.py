r"""The trainer's --parallel dp: nn.DataParallel, one process driving every visible GPU (lesson 03).

Each batch is split across the GPUs, replicas of the model run the pieces in threads, and the
outputs and gradients are gathered back on GPU 0. Easy to add, slow to scale (03_dp_training/README.md).
From the course folder:
    python trainer/train.py --parallel dp --train-samples 4000 --test-samples 1000 \
        --epochs 1 --num-workers 0
"""
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common`

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from common.amp import autocast_dtype
from common.checkpoints import CheckpointDir
from common.cli import base_parser, parse
from common.config import save_config
from common.data import load_mnist
from common.distributed import pick_device
from common.early_stopping import should_stop
from common.files import atomic_save, work_in_course_folder
from common.history import History
from common.loaders import DeviceLoader, loader_options
from common.log import log0
from common.metrics import EpochMeter
from common.model import Net, model_flags
from common.optim import make_optimizer, make_scheduler
from common.position import Position, steps_per_epoch
from common.signals import StopSignals
from common.warmup import warm_up

LESSON = "trainer-dp"  # the checkpoints' signature, and the default runs/trainer-dp


def train(args, model, device, train_loader, optimizer, scheduler, position, stop, amp_dtype, scaler):
    """One epoch, from position.step on. Leaves early, between two steps, when a stop was requested."""
    model.train()
    meter = position.meter(device)  # the epoch's training loss; a resumed epoch continues its own sums
    for i, (data, target) in enumerate(position.remaining(train_loader, args)):  # a resumed epoch skips its steps
        if i % args.grad_accum == 0 and stop.request:  # Ctrl-C or SIGTERM arrived
            break  # between two optimizer steps; the caller saves a checkpoint here
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        sync_now = (i + 1) % args.grad_accum == 0  # the last micro-batch of an optimizer step
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            output = model(data)
        loss = F.nll_loss(output.float(), target)
        scaler.scale(loss / args.grad_accum).backward()  # gradients add up over --grad-accum micro-batches
        if sync_now:
            if args.clip_grad:
                scaler.unscale_(optimizer)  # float16: clip the true gradients, not the scaled ones
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(optimizer)  # optimizer.step(); float16: skipped if a gradient overflowed
            scaler.update()  # float16: a smaller scale after an overflow, a larger one after 2000 good steps
            scheduler.step()  # the learning rate schedule advances once per optimizer step
            optimizer.zero_grad(set_to_none=True)
            position.step += 1
        meter.update(loss.detach() * len(data), 0, len(data))  # a SUM, so the epoch's mean is exact
    return meter.all_reduce()


@torch.no_grad()
def test(args, model, device, test_loader, amp_dtype):
    model.eval()
    meter = EpochMeter(device)
    for data, target in test_loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            output = model(data)
        loss_sum = F.nll_loss(output.float(), target, reduction="sum")
        meter.update(loss_sum, (output.argmax(dim=1) == target).sum(), len(data))
    return meter.all_reduce()


def make_loader(args, dataset, batch_size, sampler, device):
    """Batches of the sampler's indices: a DataLoader, or with --data-on-device slices of tensors on the GPU."""
    if args.data_on_device:
        return DeviceLoader(dataset, batch_size, sampler, device)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **loader_options(args, device))


def checkpoint_state(model, optimizer, scheduler, scaler, position, history, checkpoints):
    """Everything needed to continue: weights, optimizer and schedule state, and how far training got."""
    return {"model": model.module.state_dict(),  # .module: the plain Net inside DataParallel
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
            "position": position.state_dict(), "history": history.state_dict(), "run": checkpoints.run}


def save_checkpoint(path, model, optimizer, scheduler, scaler, position, history, checkpoints):
    state = checkpoint_state(model, optimizer, scheduler, scaler, position, history, checkpoints)
    atomic_save(state, path)  # a temporary file renamed into place: a crash never leaves half a checkpoint


def load_checkpoint(path, model, optimizer, scheduler, scaler, position, history, checkpoints, device):
    checkpoint = torch.load(path, map_location=device, weights_only=True)  # tensors and plain data, never code
    model.module.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    if checkpoint.get("scaler"):  # float16 runs: the loss scale reached (other runs save an empty one)
        scaler.load_state_dict(checkpoint["scaler"])
    position.load_state_dict(checkpoint["position"])
    history.load_state_dict(checkpoint["history"], position.epoch)


def describe_gpu_paths(n_gpus):
    """How GPU 0 reaches each other GPU: peer to peer (NVLink or PCIe), or through host memory (slow)."""
    if n_gpus < 2:
        return "one device: no copies between GPUs"
    return "\n".join(f"GPU 0 <-> GPU {other}: peer-to-peer access (NVLink or PCIe): direct copies"
                     if torch.cuda.can_device_access_peer(0, other) else
                     f"warning: GPU 0 <-> GPU {other}: no peer access, every copy goes through host memory "
                     f"and is slow (see `nvidia-smi topo -m`)" for other in range(1, n_gpus))


def main(argv=None):
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    parser = base_parser(LESSON, "Lesson 03: MNIST with nn.DataParallel over the visible GPUs")
    args = parse(parser, argv)
    checkpoints = CheckpointDir(args, LESSON)

    device = pick_device(args.device)  # cuda if there is a GPU, else cpu
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False  # DP's threads are new at every step; cuDNN would autotune at each
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # float32 matmuls on TF32 tensor cores
    torch.manual_seed(args.seed)
    n_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    log0(f"lesson 03: 1 process, nn.DataParallel over {n_gpus} GPUs, {args.batch_size // max(n_gpus, 1)} images each"
         if n_gpus > 1 else f"lesson 03: DataParallel needs 2+ GPUs and does nothing on {device}: one process")
    log0(describe_gpu_paths(n_gpus))  # DataParallel copies to and from GPU 0 at every step
    resume = checkpoints.resume_from(args.resume)  # before anything slow: a used --output-dir is refused

    train_ds, val_ds, test_ds = load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples,
                                           args.val_samples, seed=args.seed)  # --val-samples: held out of train
    train_sampler = RandomSampler(train_ds, generator=torch.Generator())  # reseeded every epoch below
    train_loader = make_loader(args, train_ds, args.batch_size, train_sampler, device)
    val_loader = make_loader(args, val_ds, args.test_batch_size, SequentialSampler(val_ds), device) if val_ds else None
    test_loader = make_loader(args, test_ds, args.test_batch_size, SequentialSampler(test_ds), device)

    amp_dtype = autocast_dtype(args.amp, device)  # --amp: bfloat16 where the device has it natively, else float16
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # float16 needs loss scaling
    model = Net(**model_flags(args)).to(device)  # the master copy lives on GPU 0 (cuda:0)
    if args.compile:
        model.compile(backend=args.compile)  # torch.compile in place: state_dict keys stay the same
    model = nn.DataParallel(model)  # --batch-size is split across the GPUs at every step (on CPU: a no-op)
    optimizer = make_optimizer(args, model.parameters())  # --optimizer, --lr (default: Adadelta, lr 1.0)
    scheduler = make_scheduler(args, optimizer, steps_per_epoch(train_loader, args))  # --schedule (default: lr x 0.7 every epoch)
    warmup_s = warm_up(model, optimizer, train_loader, device, args, amp_dtype)  # one-off costs, timed apart, then undone
    position, history = Position(), History(args, LESSON, device, warmup_seconds=warmup_s)
    if resume:  # --resume auto: the newest good checkpoint
        load_checkpoint(resume, model, optimizer, scheduler, scaler, position, history, checkpoints, device)
    save_config(args, f"{args.output_dir}/config.yaml")  # --config this file replays the run

    with StopSignals(signal.SIGINT, signal.SIGTERM) as stop:  # Ctrl-C, or Slurm's scancel and time limit
        for epoch in range(position.epoch, args.epochs + 1):
            train_sampler.generator.manual_seed(args.seed + epoch)  # a new, reproducible order each epoch
            train_stats = train(args, model, device, train_loader, optimizer, scheduler, position, stop, amp_dtype, scaler)
            if stop.request:  # save where we are; the same command with --resume auto continues here
                save_checkpoint(checkpoints.path(position), model, optimizer, scheduler, scaler, position, history, checkpoints)
                stop.report(position.epoch, position.step)
                break
            val_stats = test(args, model, device, val_loader, amp_dtype) if val_loader else None
            history.add(epoch, train_stats, test(args, model, device, test_loader, amp_dtype), val_stats, scheduler.get_last_lr()[0])
            position.next_epoch()
            path = checkpoints.path(position)
            save_checkpoint(path, model, optimizer, scheduler, scaler, position, history, checkpoints)
            checkpoints.prune(path, best=history.best_epoch == epoch)  # the newest --keep-checkpoints, and best.pt
            if should_stop(history.rows, args.target_accuracy, args.patience):  # the target reached, or --patience
                break
    history.close()
    return history.record  # the numbers of metrics.json, e.g. for a notebook


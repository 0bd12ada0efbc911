r"""The trainer's --parallel ddp: DistributedDataParallel, one process per GPU or CPU slot (lesson 04).

Every process holds a full replica, trains on its own shard of the data, and DDP all_reduces
the gradients during backward, so all replicas take the same optimizer step. From the course folder:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 trainer/train.py --parallel ddp --data synthetic \
        --train-samples 4000 --test-samples 1000 --epochs 2 --num-workers 0
"""
import signal
import socket
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common`

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from common.amp import autocast_dtype
from common.checkpoints import CheckpointDir
from common.cli import base_parser, parse
from common.config import save_config
from common.data import load_mnist
from common.distributed import init_timeout, launch_env, pick_device, restart_safe_store
from common.early_stopping import should_stop
from common.errors import CourseError
from common.exits import out_of_memory_advice
from common.files import atomic_save, work_in_course_folder
from common.history import History
from common.loaders import DeviceLoader, loader_options
from common.log import log0, log_all
from common.metrics import EpochMeter
from common.model import Net, model_flags
from common.optim import make_optimizer, make_scheduler
from common.position import Position, steps_per_epoch
from common.samplers import EvalSampler
from common.signals import StopSignals
from common.warmup import warm_up

LESSON = "trainer-ddp"  # the checkpoints' signature, and the default runs/trainer-ddp


def train(args, model, device, train_loader, optimizer, scheduler, position, stop, stop_group, amp_dtype, scaler):
    """One epoch, from position.step on. Leaves early, between two steps, when a stop was requested."""
    model.train()
    meter = position.meter(device)  # the epoch's training loss; a resumed epoch continues its own sums
    for i, (data, target) in enumerate(position.remaining(train_loader, args)):  # a resumed epoch skips its steps
        # a collective (all_reduce): every rank calls it
        if i % args.grad_accum == 0 and position.step % 10 == 0 and stop.agreed(stop_group):  # every 10 steps
            break  # between two optimizer steps; the caller saves a checkpoint here
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        sync_now = (i + 1) % args.grad_accum == 0  # the last micro-batch of an optimizer step
        with model.no_sync() if isinstance(model, DDP) and not sync_now else nullcontext():  # no all_reduce yet
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                output = model(data)
            loss = F.nll_loss(output.float(), target)
            scaler.scale(loss / args.grad_accum).backward()  # when syncing, DDP all_reduces (averages) the gradients here
        if sync_now:
            if args.clip_grad:  # DDP's gradients are already averaged, the same on every rank: so is the norm
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
    net = model.module if isinstance(model, DDP) else model  # .module: the plain Net inside DDP
    return {"model": net.state_dict(),
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
            "position": position.state_dict(),  # a collective (all_gather_object): every rank's random state
            "history": history.state_dict(), "run": checkpoints.run}


def save_checkpoint(path, model, optimizer, scheduler, scaler, position, history, checkpoints):
    # Every rank builds the state: position.state_dict() gathers every rank's random state (a collective).
    state = checkpoint_state(model, optimizer, scheduler, scaler, position, history, checkpoints)
    if dist.get_rank() == 0:  # the replicas are identical: one file, written by rank 0
        atomic_save(state, path)  # a temporary file renamed into place: a crash never leaves half a checkpoint
    dist.barrier()  # no rank goes on (or reads it) before the file is complete


def load_checkpoint(path, model, optimizer, scheduler, scaler, position, history, checkpoints, device):
    # Every rank reads the file; map_location puts rank 0's saved tensors on THIS rank's device.
    checkpoint = torch.load(path, map_location=device, weights_only=True)  # tensors and plain data, never code
    (model.module if isinstance(model, DDP) else model).load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    if checkpoint.get("scaler"):  # float16 runs: the loss scale reached (other runs save an empty one)
        scaler.load_state_dict(checkpoint["scaler"])
    position.load_state_dict(checkpoint["position"])
    history.load_state_dict(checkpoint["history"], position.epoch)


@out_of_memory_advice("under DDP every GPU holds the whole model, its gradients and AdamW state (16 bytes a "
                      "parameter): shard them with FSDP2 (lesson 05)")
def main(argv=None):
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    parser = base_parser(LESSON, "Lesson 04: MNIST with DistributedDataParallel (torchrun or srun)")
    parser.add_argument("--sync-bn", action="store_true",
                        help="add BatchNorm and synchronise its statistics across GPUs (GPU only)")
    args = parse(parser, argv)
    checkpoints = CheckpointDir(args, LESSON)
    resume = checkpoints.resume_from(args.resume)  # first, before anything slow: a used --output-dir is refused

    env = launch_env()  # RANK, LOCAL_RANK, WORLD_SIZE from torchrun, or from srun's SLURM_* variables
    device = pick_device(args.device, env)  # cuda:LOCAL_RANK: the GPU is chosen by the rank WITHIN the node
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this process uses this GPU, and only this one
        torch.backends.cudnn.benchmark = True  # fixed input shapes: cuDNN times its convolutions once, keeps the fastest
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # float32 matmuls on TF32 tensor cores
    dist.init_process_group(backend=dist.get_default_backend_for_device(device),  # nccl for cuda, gloo for cpu
                            timeout=init_timeout(), rank=env.rank, world_size=env.world_size,  # meet at MASTER_ADDR:PORT
                            store=restart_safe_store(env), device_id=device if device.type == "cuda" else None)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # rank 0 of world_size does the writing
    stop_group = dist.new_group(backend="gloo")  # a CPU side channel for stop.agreed, next to the GPUs' NCCL
    log_all(f"host {socket.gethostname()} rank {rank}/{world_size} local_rank {env.local_rank} "
            f"device {device} backend {dist.get_backend()}")
    if args.sync_bn and device.type != "cuda":
        raise CourseError("--sync-bn needs GPUs (SyncBatchNorm only works with CUDA modules): drop it on CPU")
    torch.manual_seed(args.seed)  # the same seed on every rank: identical initial weights

    train_ds, val_ds, test_ds = load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples,
                                           args.val_samples, seed=args.seed,  # the same split on every rank
                                           is_main=rank == 0, barrier=dist.barrier)  # rank 0 downloads, the rest wait
    # Shard by GLOBAL rank: with the local rank, every node would train on the same shard.
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = make_loader(args, train_ds, args.batch_size, train_sampler, device)
    # EvalSampler: every image on exactly one rank (DistributedSampler would pad with duplicates); sums over ranks.
    val_loader = make_loader(args, val_ds, args.test_batch_size, EvalSampler(val_ds), device) if val_ds else None
    test_loader = make_loader(args, test_ds, args.test_batch_size, EvalSampler(test_ds), device)

    amp_dtype = autocast_dtype(args.amp, device)  # --amp: bfloat16 where the device has it natively, else float16
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # float16 needs loss scaling
    model = Net(**model_flags(args), batch_norm=args.sync_bn).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # --sync-bn: BatchNorm statistics over ALL ranks
    if world_size > 1:  # one process has nothing to average: no wrap, no hooks in its backward (as nanoGPT does)
        # DDP broadcasts rank 0's weights at construction, then all_reduces gradients in backward.
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)  # gradients live in the all_reduce buckets: one copy less
    if args.compile:
        model.compile(backend=args.compile)  # AFTER the wrap: Dynamo splits the graph at DDP's buckets
    torch.manual_seed(args.seed + rank)  # from here on each rank its own stream: different dropout masks
    log0(f"lesson 04: {world_size} process{'es' if world_size > 1 else ''}, {args.batch_size} images each per "
         f"micro-batch, effective batch {args.batch_size * args.grad_accum * world_size}")
    optimizer = make_optimizer(args, model.parameters(), world_size)  # --lr-scaling uses the world size
    scheduler = make_scheduler(args, optimizer, steps_per_epoch(train_loader, args))  # --schedule (default: lr x 0.7 every epoch)
    # a collective: every rank calls it (its steps are training steps)
    warmup_s = warm_up(model, optimizer, train_loader, device, args, amp_dtype)  # one-off costs, timed apart, then undone
    position, history = Position(), History(args, LESSON, device, warmup_seconds=warmup_s)
    if resume:  # --resume auto: the newest good checkpoint
        load_checkpoint(resume, model, optimizer, scheduler, scaler, position, history, checkpoints, device)
    save_config(args, f"{args.output_dir}/config.yaml")  # --config this file replays the run

    with StopSignals(signal.SIGINT, signal.SIGTERM, signal.SIGUSR1) as stop:  # + Slurm's warning before the limit
        for epoch in range(position.epoch, args.epochs + 1):
            train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
            train_stats = train(args, model, device, train_loader, optimizer, scheduler, position, stop, stop_group, amp_dtype, scaler)
            # a collective (all_reduce): every rank calls it
            if stop.agreed(stop_group, now=True):  # also a request after the epoch's last check: all ranks save here
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
    dist.destroy_process_group()
    return history.record  # the numbers of metrics.json, e.g. for a notebook


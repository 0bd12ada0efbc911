"""Lesson 05: FSDP2 (fully_shard): each process keeps only a 1/N shard of weights, grads and optimizer state.

Before a layer runs, its full weights are all-gathered; after backward, gradients are
reduce-scattered so each rank updates only its shard. Memory per GPU falls as ranks grow:
    torchrun --standalone --nproc_per_node=2 mnist_fsdpmodel.py --epochs 1 --data synthetic --width 4
"""
import signal
import socket

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DistributedSampler

from common.checkpoints import CheckpointDir
from common.cli import base_parser, parse, positive_int, run
from common.data import load_mnist
from common.distributed import init_timeout, launch_env, pick_backend, pick_device, restart_safe_store
from common.files import atomic_save
from common.loaders import make_loader, steps_per_epoch
from common.log import log0, log_all
from common.metrics import EpochMeter
from common.model import Net, count_parameters, init_sharded, read_full_weights
from common.optim import make_optimizer, make_scheduler
from common.profiling import warm_up
from common.progress import Progress
from common.samplers import EvalSampler

LESSON = "05_multigpu_fsdp_training"


def train(args, model, device, train_loader, optimizer, scheduler, progress):
    model.train()
    batches = progress.batches(train_loader, per_step=args.grad_accum)  # skips what a restarted epoch did
    for i, (data, target) in enumerate(batches, 1):
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        sync_now = i % args.grad_accum == 0  # the last micro-batch of an optimizer step
        # FSDP's no_sync: skip the reduce-scatter until the last micro-batch (unsharded gradients pile up meanwhile).
        model.set_requires_gradient_sync(sync_now)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            output = model(data)  # each layer all-gathers its weights, runs, frees them again
        loss = F.nll_loss(output.float(), target)
        (loss / args.grad_accum).backward()  # when syncing, gradients are reduce-scattered: each rank keeps its shard
        if sync_now:
            if args.clip_grad:  # the norm over ALL shards of all ranks, a DTensor: .full_tensor() to print it
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()  # updates only this rank's shard of weights and optimizer state
            scheduler.step()  # the learning rate schedule advances once per optimizer step
            optimizer.zero_grad(set_to_none=True)
        progress.add_loss(loss, len(data))
    if args.clip_grad and progress.step > 0:
        log0(f"gradient norm before clipping, last step: {norm.full_tensor().item():.3f}")


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


def checkpoint_state(model, optimizer, scheduler, progress):
    model_state, optimizer_state = get_state_dict(model, optimizer)  # this rank's shards, as DTensors: no copies
    return {"model": model_state, "optimizer": optimizer_state,  # progress.state_dict(): every rank's RNG
            "scheduler": scheduler.state_dict(), "progress": progress.state_dict()}


def save_checkpoint(path, model, optimizer, scheduler, progress):
    """No rank holds the whole model: with DCP every rank writes its own shards, in parallel, into one folder."""
    scratch = path.with_name(path.name + ".tmp")
    dcp.save(checkpoint_state(model, optimizer, scheduler, progress), checkpoint_id=scratch)
    dist.barrier()  # every rank's shards are on disk
    if dist.get_rank() == 0:
        scratch.rename(path)  # only a complete checkpoint gets its name
    dist.barrier()


def load_checkpoint(path, model, optimizer, scheduler, progress, device):
    """DCP reads the pieces THIS rank's shards need, whatever the number of ranks that wrote them."""
    state = checkpoint_state(model, optimizer, scheduler, progress)
    dcp.load(state, checkpoint_id=path)  # in place, into the tensors of `state`
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    progress.load_state_dict(state["progress"])


def main(argv=None):
    parser = base_parser(LESSON, "Lesson 05: MNIST with FSDP2 (fully_shard) and sharded DCP checkpoints")
    parser.add_argument("--grad-accum", type=positive_int, default=1,
                        help="micro-batches per optimizer step; the reduce-scatter runs once per step (default: 1)")
    parser.add_argument("--clip-grad", type=float, metavar="MAX_NORM", help="clip the gradients' norm (default: off)")
    parser.add_argument("--hsdp", action="store_true", help="HSDP: replicate across nodes, shard within each")
    parser.add_argument("--prefetch", action="store_true", help="all-gather the next layer's weights early")
    parser.add_argument("--init-from", metavar="PATH", help="start from a lesson 04 .pt or a model_full.pt")
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
    torch.manual_seed(args.seed)  # the same seed on every rank: identical initial weights

    train_ds, test_ds = load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples,
                                   is_main=rank == 0, barrier=dist.barrier)  # rank 0 downloads, the rest wait
    # Shard by GLOBAL rank: with the local rank, every node would train on the same shard.
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    test_sampler = EvalSampler(test_ds, num_replicas=world_size, rank=rank)  # no padded duplicates
    train_loader = make_loader(train_ds, args.batch_size, train_sampler, device, args.num_workers, args.data_on_device)
    test_loader = make_loader(test_ds, args.test_batch_size, test_sampler, device, args.num_workers,
                              args.data_on_device)

    with torch.device("meta"):  # shapes only, no memory and no values: no rank ever holds the whole model
        model = Net(width=args.width)
    nodes = world_size // env.local_world_size  # HSDP: replicate across the nodes, shard within each node
    mesh = init_device_mesh(device.type, (nodes, world_size // nodes), mesh_dim_names=("replicate", "shard")) \
        if args.hsdp else init_device_mesh(device.type, (world_size,))  # else a 1-D mesh: shard over all ranks
    # --amp: weights all-gathered and used in bf16, gradients reduced in fp32, fp32 master shards; else all fp32.
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.amp else None, reduce_dtype=torch.float32)
    layers = [model.conv1, model.conv2, model.fc1, model.fc2]
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)  # one all-gather unit per layer
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)  # the root: whatever is left over
    for this, after in zip(layers, layers[1:]) if args.prefetch else ():  # ask for the next unit's weights early
        this.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([this])
    model.to_empty(device=device)  # this rank's shards, allocated on the device, not yet initialised
    init_sharded(model, args.seed)  # the values Net() draws with this seed, one layer at a time (common/model.py)
    if args.init_from:  # a plain Net's full weights: rank 0 reads them and broadcasts, each rank keeps its shard
        set_model_state_dict(model, read_full_weights(args.init_from, model) if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    if args.compile:
        model = torch.compile(model)  # fuses kernels; the first steps pay for compilation
    torch.manual_seed(args.seed + rank)  # from here on each rank its own stream: different dropout masks
    log0(f"lesson 05: {world_size} processes, mesh {tuple(mesh.shape)}, {count_parameters(model) / 1e6:.1f} M parameters,"
         f" each rank stores ~1/{mesh.shape[-1]}; effective batch {args.batch_size * args.grad_accum * world_size}")
    optimizer = make_optimizer(args, model.parameters(), world_size)  # --lr-scaling uses the world size
    scheduler = make_scheduler(args, optimizer, steps_per_epoch(train_loader, args))  # --schedule (default: lr x 0.7 every epoch)
    warmup_s = warm_up(model, optimizer, train_loader, device, args)  # one-off costs, timed apart, then undone
    progress = Progress(args, LESSON, device, world_size, warmup_seconds=warmup_s)
    progress.stop_on(signal.SIGUSR1, signal.SIGTERM)  # Slurm: time limit near, or preemption
    checkpoints = CheckpointDir(args.output_dir, args, LESSON, sharded=True)
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
    if not progress.stopped:  # one plain file for inference: the full weights, gathered onto rank 0's CPU
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            atomic_save(full, f"{args.output_dir}/model_full.pt")  # loads into a plain Net
    dist.destroy_process_group()
    return progress.record  # the numbers of metrics.json, e.g. for a notebook


if __name__ == "__main__":
    run(main)

r"""The trainer's --parallel tp and 2d: tensor parallelism in groups of --tp processes, FSDP2 across them (lesson 06).

The head's blocks are Megatron pairs: `up` is cut by output columns, `down` by input rows, so each rank of a
TP group computes a slice of every block and one all-reduce per block joins the slices. The ranks of a TP
group train on the SAME batch; the groups split the data and shard the weights with fully_shard, as in
lesson 05. From the course folder:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 trainer/train.py --parallel 2d --tp 2 \
        --blocks 2 --data synthetic --train-samples 2000 --test-samples 500 --epochs 2 --num-workers 0
"""
import logging
import math
import signal
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common`

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler

from common.amp import autocast_dtype
from common.checkpoints import CheckpointDir
from common.cli import base_parser, parse, positive_int
from common.config import save_config
from common.data import load_mnist
from common.distributed import init_timeout, launch_env, pick_device, restart_safe_store
from common.early_stopping import should_stop
from common.errors import CourseError
from common.files import atomic_save, replace_folder, work_in_course_folder
from common.history import History
from common.loaders import DeviceLoader, loader_options
from common.log import log0, log_all, plural
from common.metrics import EpochMeter
from common.model import Net, count_parameters, model_flags
from common.optim import make_optimizer, make_scheduler
from common.position import Position, steps_per_epoch
from common.samplers import EvalSampler
from common.signals import StopSignals
from common.warmup import warm_up

# torch 2.10+ logs a performance note when model_full.pt gathers a 2-D DTensor (two all-gathers): nothing to act on.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
EXPAND = 4  # a block's up projection is EXPAND x hidden wide, as in a transformer's MLP


class MLP(nn.Module):
    """x + down(relu(up(x))): a Megatron pair, hidden -> EXPAND x hidden -> hidden."""

    def __init__(self, hidden: int):
        super().__init__()
        self.up = nn.Linear(hidden, EXPAND * hidden)
        self.down = nn.Linear(EXPAND * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(x)))


class TPNet(Net):
    """The classic CNN (features, fc1, fc2) with --blocks MLP pairs as its parameter-heavy head."""

    def __init__(self, width: int = 1, blocks: int = 0, hidden: int | None = None):
        super().__init__(width=width, hidden=hidden)
        self.blocks = nn.ModuleList(MLP(self.fc1.out_features) for _ in range(blocks))  # between fc1 and fc2


TP_PLAN = {"up": ColwiseParallel(),  # weight cut by output features: each rank computes its slice of up(x)
           "down": RowwiseParallel()}  # cut by input features: partial sums, all-reduced into the block's output


def parallelize(model, mesh, mp_policy=MixedPrecisionPolicy()):
    """The 2-D layout: TP over the "tp" dimension of the mesh first, then FSDP2 over its "dp" dimension."""
    if mesh["tp"].size() > 1:
        for block in model.blocks:  # each block's weights become DTensors cut over "tp"
            parallelize_module(block, mesh["tp"], TP_PLAN)
    for unit in [model.features, model.fc1, *model.blocks, model.fc2, model]:  # units, then the root (the rest)
        fully_shard(unit, mesh=mesh["dp"], mp_policy=mp_policy)  # cut again over "dp": 1/(dp x tp) of a block
    return model


def copies(tensor) -> int:
    """How many ranks hold the same piece of this DTensor: the ranks over the pieces it is cut into."""
    pieces = math.prod(n for n, p in zip(tensor.device_mesh.shape, tensor.placements) if not p.is_replicate())
    return dist.get_world_size() // pieces


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ over a 2-D mesh: every gradient element counted once, ONE all-reduce."""
    grads = [p.grad for p in parameters if p.grad is not None]
    # A block's weight is cut over "dp" AND "tp": its pieces are disjoint. A unit under FSDP2 alone (and a
    # RowwiseParallel bias) is cut over "dp" only: the TP peers hold the same piece, each counts 1/tp of it.
    squares = sum(g.to_local().float().square().sum() / copies(g) for g in grads)
    dist.all_reduce(squares)  # the sum over every rank: the squared norm of the whole model's gradient
    total = squares.sqrt()
    torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total)  # the same scale on every rank
    return total


def train(args, model, device, train_loader, optimizer, scheduler, position, stop, stop_group, amp_dtype, scaler,
          counted):
    """One epoch, from position.step on. Leaves early, between two steps, when a stop was requested."""
    model.train()
    meter = position.meter(device)  # the epoch's training loss; a resumed epoch continues its own sums
    for i, (data, target) in enumerate(position.remaining(train_loader, args)):  # a resumed epoch skips its steps
        # a collective (all_reduce): every rank calls it
        if i % args.grad_accum == 0 and position.step % 10 == 0 and stop.agreed(stop_group):  # every 10 steps
            break  # between two optimizer steps; the caller saves a checkpoint here
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        sync_now = (i + 1) % args.grad_accum == 0  # the last micro-batch of an optimizer step
        model.set_requires_gradient_sync(sync_now)  # FSDP's no_sync: no reduce-scatter until the last one
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            output = model(data)  # a collective: FSDP all-gathers each unit's weights
        loss = F.nll_loss(output.float(), target)
        scaler.scale(loss / args.grad_accum).backward()  # when syncing, gradients are reduce-scattered: each rank keeps its shard
        if sync_now:
            if args.clip_grad:  # the norm of ALL gradients: every shard's, on both meshes (above)
                scaler.unscale_(optimizer)  # float16: clip the true gradients, not the scaled ones
                clip_grad_norm(model.parameters(), args.clip_grad)
            scaler.step(optimizer)  # optimizer.step(); float16: skipped if a gradient overflowed
            scaler.update()  # float16: a smaller scale after an overflow, a larger one after 2000 good steps
            scheduler.step()  # the learning rate schedule advances once per optimizer step
            optimizer.zero_grad(set_to_none=True)
            position.step += 1
        if counted:  # the TP peers computed the same loss on the same batch: it counts once per TP group
            meter.update(loss.detach() * len(data), 0, len(data))  # a SUM, so the epoch's mean is exact
    return meter.all_reduce()


@torch.no_grad()
def test(args, model, device, test_loader, amp_dtype, counted):
    model.eval()
    meter = EpochMeter(device)
    for data, target in test_loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            output = model(data)  # a collective: FSDP all-gathers each unit's weights
        if counted:  # once per TP group, as in train()
            loss_sum = F.nll_loss(output.float(), target, reduction="sum")
            meter.update(loss_sum, (output.argmax(dim=1) == target).sum(), len(data))
    for _ in range(test_loader.sampler.most_batches(test_loader.batch_size) - len(test_loader)):  # FSDP gathers
        model(torch.zeros(1, 1, 28, 28, device=device))  # INSIDE forward: a rank with fewer batches must join in
    return meter.all_reduce()


def make_loader(args, dataset, batch_size, sampler, device):
    """Batches of the sampler's indices: a DataLoader, or with --data-on-device slices of tensors on the GPU."""
    if args.data_on_device:
        return DeviceLoader(dataset, batch_size, sampler, device)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **loader_options(args, device))


@torch.no_grad()
def init_weights(model, args):
    """What each module's own initialisation draws after torch.manual_seed(seed), each rank keeping its piece."""
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        twin = TPNet(**model_flags(args))  # an unsharded twin, shapes only
    owners = [[m for m in net.modules() if list(m.parameters(recurse=False))] for net in (model, twin)]
    for sharded, full in zip(*owners):  # conv1, conv2, fc1, each block's up and down, fc2
        full.to_empty(device="cpu", recurse=False)  # this module's full tensors for a moment, never the whole model
        full.reset_parameters()  # the module's own initialisation, as in Net()
        for shard, value in zip(sharded.parameters(recurse=False), full.parameters(recurse=False)):
            shard.to_local().copy_(distribute_tensor(value, shard.device_mesh, shard.placements,
                                                     src_data_rank=None).to_local())  # my piece (1 or 2 cuts)
        full.to_empty(device="meta", recurse=False)  # and free it


def checkpoint_state(model, optimizer, scheduler, scaler, position, history, checkpoints):
    """Everything needed to continue: weights, optimizer and schedule state, and how far training got."""
    model_state, optimizer_state = get_state_dict(model, optimizer)  # this rank's shards, as DTensors: no copies
    return {"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),  # float16: the loss scale; else {}
            "position": position.state_dict(),  # a collective (all_gather_object): every rank's random state
            "history": history.state_dict(), "run": checkpoints.run}


def save_checkpoint(path, model, optimizer, scheduler, scaler, position, history, checkpoints):
    # No rank holds the whole model: with DCP every rank writes its own shards, in parallel, into one folder.
    scratch = path.with_name(path.name + ".tmp")
    dcp.save(checkpoint_state(model, optimizer, scheduler, scaler, position, history, checkpoints), checkpoint_id=scratch)
    dist.barrier()  # every rank's shards are on disk
    if dist.get_rank() == 0:
        replace_folder(scratch, path)  # only a complete checkpoint gets the name (an older one of it goes)
    dist.barrier()


def load_checkpoint(path, model, optimizer, scheduler, scaler, position, history, checkpoints, device):
    # DCP reads the pieces THIS rank's shards need, whatever the number of ranks that wrote them.
    checkpoint = checkpoint_state(model, optimizer, scheduler, scaler, position, history, checkpoints)
    if "scaler.scale" not in dcp.FileSystemReader(path).read_metadata().state_dict_metadata:
        checkpoint["scaler"] = {}  # a run without float16 saved no loss scale: a float16 one starts a fresh scale
    dcp.load(checkpoint, checkpoint_id=path)  # in place, into the tensors of `checkpoint`
    set_state_dict(model, optimizer, model_state_dict=checkpoint["model"], optim_state_dict=checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    if checkpoint["scaler"]:  # float16 runs: the loss scale reached
        scaler.load_state_dict(checkpoint["scaler"])
    position.load_state_dict(checkpoint["position"])
    history.load_state_dict(checkpoint["history"], position.epoch)


def main(argv=None, parallel="2d"):
    """--parallel tp: one TP group of every process (--tp defaults to their number); 2d: --tp 2 by default."""
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    lesson = f"trainer-{parallel}"  # the checkpoints' signature, and the default runs/trainer-tp or runs/trainer-2d
    parser = base_parser(lesson, "Lesson 06: MNIST with tensor parallelism inside FSDP2 (a 2-D mesh)")
    parser.add_argument("--tp", type=positive_int, default=launch_env().world_size if parallel == "tp" else 2,
                        help="tensor-parallel degree: processes per TP group; data-parallel degree = processes / "
                             "TP (default: every process under --parallel tp, 2 under 2d; 1 is FSDP2)")
    args = parse(parser, argv)
    hidden = args.hidden or 128 * args.width
    if EXPAND * hidden % args.tp:  # ColwiseParallel cuts the EXPAND x hidden features evenly
        parser.error(f"argument --tp: must divide the {EXPAND} x {hidden} features of a block, got {args.tp}")
    checkpoints = CheckpointDir(args, lesson, sharded=True)
    resume = checkpoints.resume_from(args.resume)  # first, before anything slow: a used --output-dir is refused

    env = launch_env()  # RANK, LOCAL_RANK, WORLD_SIZE from torchrun, or from srun's SLURM_* variables
    if env.world_size % args.tp:  # plain python is ONE process: the default --tp 2 needs torchrun
        raise CourseError(f"--tp {args.tp} does not divide the {env.world_size} process{'es' * (env.world_size > 1)}: "
                          f"pick a divisor of {env.world_size} (e.g. --tp {env.local_world_size}: TP inside each node), "
                          f"or start a multiple of {args.tp} processes (torchrun --nproc_per_node={args.tp})")
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
    torch.manual_seed(args.seed)  # the same seed on every rank: identical initial weights

    train_ds, val_ds, test_ds = load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples,
                                           args.val_samples, seed=args.seed,  # the same split on every rank
                                           is_main=rank == 0, barrier=dist.barrier)  # rank 0 downloads, the rest wait
    # The mesh: rows are data-parallel replicas, columns the ranks of a TP group (neighbours: inside a node).
    mesh = init_device_mesh(device.type, (world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp, dp_rank, tp_rank = mesh.size(0), mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    # Shard by DATA-PARALLEL rank: the ranks of a TP group must see the same batch, each computing a slice of it.
    train_sampler = DistributedSampler(train_ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=args.seed)
    train_loader = make_loader(args, train_ds, args.batch_size, train_sampler, device)
    # EvalSampler: every image on exactly one rank (DistributedSampler would pad with duplicates); sums over ranks.
    val_loader = make_loader(args, val_ds, args.test_batch_size, EvalSampler(val_ds, dp, dp_rank), device) if val_ds else None
    test_loader = make_loader(args, test_ds, args.test_batch_size, EvalSampler(test_ds, dp, dp_rank), device)

    amp_dtype = autocast_dtype(args.amp, device)  # --amp: bfloat16 where the device has it natively, else float16
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # float16 needs loss scaling
    with torch.device("meta"):  # shapes only, no memory and no values: no rank ever holds the whole model
        model = TPNet(**model_flags(args))
    # --amp: bf16 or fp16 gathers and compute, fp32 gradient reduction and master shards. The GradScaler above works
    # on the sharded gradients as they are: DTensor all-reduces its inf/NaN check, so every rank skips the same steps.
    mp_policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)
    parallelize(model, mesh, mp_policy)  # TP inside each group, FSDP2 across them (above)
    model.to_empty(device=device)  # this rank's shards, allocated, not initialised
    init_weights(model, args)  # the values TPNet draws with --seed, one module at a time (above)
    if args.compile:
        model.compile(backend=args.compile)  # torch.compile in place, after fully_shard
    torch.manual_seed(args.seed + dp_rank)  # one stream per TP group: TP peers draw the SAME dropout masks
    log0(f"lesson 06: {world_size} process{'es' if world_size > 1 else ''}, mesh dp {dp} x tp {args.tp}, "
         f"{count_parameters(model) / 1e6:,.1f} M parameters: each block cut in {plural(world_size, 'piece')}, "
         f"the rest in {plural(dp, 'piece')}")
    optimizer = make_optimizer(args, model.parameters(), dp)  # --lr-scaling: data-parallel replicas
    scheduler = make_scheduler(args, optimizer, steps_per_epoch(train_loader, args))  # --schedule (default: lr x 0.7 every epoch)
    # a collective: every rank calls it (its steps are training steps)
    warmup_s = warm_up(model, optimizer, train_loader, device, args, amp_dtype)  # one-off costs, timed apart, then undone
    position, history = Position(), History(args, lesson, device, warmup_seconds=warmup_s)
    if resume:  # --resume auto: the newest good checkpoint
        load_checkpoint(resume, model, optimizer, scheduler, scaler, position, history, checkpoints, device)
    save_config(args, f"{args.output_dir}/config.yaml")  # --config this file replays the run

    with StopSignals(signal.SIGINT, signal.SIGTERM, signal.SIGUSR1) as stop:  # + Slurm's warning before the limit
        for epoch in range(position.epoch, args.epochs + 1):
            train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
            train_stats = train(args, model, device, train_loader, optimizer, scheduler, position, stop, stop_group, amp_dtype, scaler,
                                tp_rank == 0)
            # a collective (all_reduce): every rank calls it
            if stop.agreed(stop_group, now=True):  # also a request after the epoch's last check: all ranks save here
                save_checkpoint(checkpoints.path(position), model, optimizer, scheduler, scaler, position, history, checkpoints)
                stop.report(position.epoch, position.step)
                break
            val_stats = test(args, model, device, val_loader, amp_dtype, tp_rank == 0) if val_loader else None
            history.add(epoch, train_stats, test(args, model, device, test_loader, amp_dtype, tp_rank == 0), val_stats,
                        scheduler.get_last_lr()[0])
            position.next_epoch()
            path = checkpoints.path(position)
            save_checkpoint(path, model, optimizer, scheduler, scaler, position, history, checkpoints)
            checkpoints.prune(path, best=history.best_epoch == epoch)  # the newest --keep-checkpoints, and best.pt
            if should_stop(history.rows, args.target_accuracy, args.patience):  # the target reached, or --patience
                break
        history.close()
        # a collective (all_reduce): one more vote, so a request after the last one (in the last test or save) stops
        # every rank or none: a rank that skipped the gather alone would leave the others waiting in it
        if stop.agreed(stop_group, now=True):
            stop.report(position.epoch, position.step)  # the last epoch's checkpoint is saved; said once
        else:  # one plain file for inference: the full weights, gathered onto rank 0's CPU (a collective: all-gathers)
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                atomic_save(full, f"{args.output_dir}/model_full.pt")  # loads into a plain TPNet
        dist.destroy_process_group()  # inside the `with`: a late SIGUSR1 is written down, not the end of the process
    return history.record  # the numbers of metrics.json, e.g. for a notebook


r"""The trainer's --parallel pp: pipeline stages on the ranks of a pipeline, FSDP2 across --dp pipelines (lesson 07).

Stage 0 holds the features, fc1 and the first blocks; the last stage the other blocks, fc2 and the loss. A stage
sends its activations to the next one and gets their gradients back (point-to-point, no collective); the schedule
(--pp-schedule) orders the micro-batches' forwards and backwards, and the ranks idle while the pipeline fills and
drains: the bubble. The ranks of a pipeline read the SAME batch. From the course folder:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 trainer/train.py --parallel pp \
        --pp-schedule 1f1b --data synthetic --train-samples 6000 --test-samples 500 --epochs 2 --num-workers 0 \
        --lr 0.5
"""
import signal
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common`
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "07_pipeline_parallel"))  # lesson 07's stages

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, Subset

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
from stages import Stage, check_resume, init_weights, replicas, stage_blocks
from torch_floor import require_torch_2_10

LESSON = "trainer-pp"  # the checkpoints' signature, and the default runs/trainer-pp
# name: (schedule, stages per rank). With 2 per rank, pp-rank r holds stages r and r + pp (the "loop" placement).
# ScheduleZBVZeroBubble (a V: stages r and 2 pp - 1 - r) trains too, but its eval() fails in torch 2.14.1.
SCHEDULES = {"gpipe": (ScheduleGPipe, 1), "1f1b": (Schedule1F1B, 1), "interleaved": (ScheduleInterleaved1F1B, 2),
             "zb": (ScheduleInterleavedZeroBubble, 2)}
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # the checkpoint's optimizer state: keys per parameter


def build(args, mesh, device, amp_dtype=None, mp_policy=MixedPrecisionPolicy()):
    """This rank's stages (PipelineStage's submodules) and `model`: all its layers in one module, for the optimizer and
    the checkpoint. Built on the meta device: no rank ever holds the whole model."""
    pp, pp_rank, per_rank = mesh.size(0), mesh.get_local_rank("pp"), SCHEDULES[args.pp_schedule][1]
    ids, count = [pp_rank, pp_rank + pp][:per_rank], pp * per_rank  # this rank's stages, and all of them
    with torch.device("meta"):
        net = Net(**model_flags(args))
    total = count_parameters(net)  # shapes only: every stage's
    ranges = stage_blocks(args.blocks, count)
    if any(len(r) == 0 for r in ranges[1:-1]):  # a middle stage holds blocks only
        raise CourseError(f"--blocks {args.blocks} leaves a middle stage of {count} empty: use --blocks {count - 1} "
                          f"or more (or fewer processes)")
    stages = [Stage(net, ranges[s], s == 0, s == count - 1, amp_dtype) for s in ids]
    model = Stage(net, [b for s in ids for b in ranges[s]], 0 in ids, count - 1 in ids)  # the same modules, all
    if mesh.size(1) > 1:  # FSDP2 over "dp" on each stage: its units, then the stage (its root)
        for stage in stages:
            for unit in stage.units():  # gathered once per step, not once per micro-batch (reference.md)
                fully_shard(unit, mesh=mesh["dp"], mp_policy=mp_policy, reshard_after_forward=False)
            fully_shard(stage, mesh=mesh["dp"], mp_policy=mp_policy)  # the schedule runs FSDP's post-backward
    model.to_empty(device=device)  # this rank's layers (its shards of them under FSDP2), allocated, not initialised
    init_weights(model, args)
    for stage in stages if args.compile else []:
        stage.compile(backend=args.compile)  # torch.compile in place, after fully_shard
    return stages, ids, count, model, total


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean loss of ONE micro-batch, computed by the schedule on the last stage."""
    return F.nll_loss(output.float(), target)


def make_schedule(args, stages, ids, count, group, device, training: bool):
    """The schedule over this rank's PipelineStages. step() divides each gradient by --microbatches at its end
    (scale_grads=True): the micro-batches' MEAN losses give the batch's mean, as one process computes it.
    A PipelineStage learns the shapes it sends and receives from its first micro-batch: evaluation's differ, so
    it gets PipelineStages (the same modules) and a schedule of its own."""
    schedule, per_rank = SCHEDULES[args.pp_schedule]
    pipe = [PipelineStage(stage, s, count, device, group=group) for stage, s in zip(stages, ids)]
    try:
        return schedule(pipe[0] if per_rank == 1 else pipe, args.microbatches, loss_fn=loss_fn if training else None)
    except ValueError as e:  # e.g. interleaved 1F1B: --microbatches a multiple of its rounds
        raise CourseError(f"--pp-schedule {args.pp_schedule} --microbatches {args.microbatches}: {e}") from None


def clip_grad_norm(parameters, max_norm: float, device) -> torch.Tensor:
    """clip_grad_norm_ over the pipeline: each rank's stages (and FSDP2 shards) are disjoint, ONE all-reduce."""
    grads = [p.grad for p in parameters if p.grad is not None]
    squares = sum(((g.to_local() if isinstance(g, DTensor) else g).float().square().sum() for g in grads),
                  torch.zeros((), device=device))  # a rank may hold no gradient at all
    dist.all_reduce(squares)  # the sum over every rank: the squared norm of the whole model's gradient
    total = squares.sqrt()
    torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total)  # the same scale on every rank
    return total


def train(args, model, schedule, device, train_loader, optimizer, scheduler, position, stop, stop_group, first, last):
    """One epoch, from position.step on. Leaves early, between two steps, when a stop was requested."""
    model.train()
    meter = position.meter(device)  # the epoch's training loss; a resumed epoch continues its own sums
    for data, target in position.remaining(train_loader, args):  # a resumed epoch skips its steps
        # a collective (all_reduce): every rank calls it
        if position.step % 10 == 0 and stop.agreed(stop_group):  # every 10 steps
            break  # between two optimizer steps; the caller saves a checkpoint here
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        losses = []  # the last stage's loss of each micro-batch
        # The whole step: forwards and backwards of every micro-batch in the schedule's order, sends and receives.
        # Stage 0 gets the images, the last stage the labels; a rank with neither waits for its neighbours.
        schedule.step(*[data] * first, target=target if last else None, losses=losses, return_outputs=False)
        if args.clip_grad:  # the norm of ALL gradients: every stage's (above)
            clip_grad_norm(model.parameters(), args.clip_grad, device)
        optimizer.step()
        scheduler.step()  # the learning rate schedule advances once per optimizer step
        optimizer.zero_grad(set_to_none=True)
        position.step += 1
        if last:  # once per pipeline: the last stage has the losses (equal micro-batches: their mean is the batch's)
            meter.update(torch.stack(losses).detach().mean() * len(data), 0, len(data))  # a SUM, so the mean is exact
    return meter.all_reduce()


@torch.no_grad()
def test(args, model, schedule, device, test_loader, first, last):
    model.eval()
    meter = EpochMeter(device)
    for data, target in test_loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        pad = args.test_batch_size - len(data)  # the stages' shapes are fixed: zeros fill a smaller batch...
        output = schedule.eval(*[F.pad(data, (0, 0, 0, 0, 0, 0, 0, pad))] * first)
        if last:  # ...and only the real images count
            loss_sum = F.nll_loss(output[:len(data)].float(), target, reduction="sum")
            meter.update(loss_sum, (output[:len(data)].argmax(dim=1) == target).sum(), len(data))
    for _ in range(test_loader.sampler.most_batches(test_loader.batch_size) - len(test_loader)):  # FSDP gathers
        schedule.eval(*[torch.zeros(args.test_batch_size, 1, 28, 28, device=device)] * first)  # INSIDE forward
    return meter.all_reduce()  # all_reduce (SUM): the last stages' numbers reach every rank


def make_loader(args, dataset, batch_size, sampler, device):
    """Batches of the sampler's indices: a DataLoader, or with --data-on-device slices of tensors on the GPU."""
    if args.data_on_device:
        return DeviceLoader(dataset, batch_size, sampler, device)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **loader_options(args, device))


def checkpoint_state(model, optimizer, scheduler, position, history, checkpoints):
    """Everything needed to continue: weights, optimizer and schedule state, and how far training got."""
    # Under Net's names, and (flatten) the optimizer's param groups too: the stages hold different layers, and DCP
    # writes a key that several ranks have ONCE (param_groups.0.params would be one rank's list of names).
    model_state, optimizer_state = get_state_dict(model, optimizer, options=FLAT)  # FSDP2: the shards again
    return {"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
            "position": position.state_dict(),  # a collective (all_gather_object): every rank's random state
            "history": history.state_dict(), "run": checkpoints.run, "dp": replicas(model)}


def save_checkpoint(path, model, optimizer, scheduler, position, history, checkpoints):
    # With DCP every rank writes its own stages (its shards of them under FSDP2), in parallel, into one folder.
    scratch = path.with_name(path.name + ".tmp")
    dcp.save(checkpoint_state(model, optimizer, scheduler, position, history, checkpoints), checkpoint_id=scratch)
    dist.barrier()  # every rank's stages are on disk
    if dist.get_rank() == 0:
        replace_folder(scratch, path)  # only a complete checkpoint gets the name (an older one of it goes)
    dist.barrier()


def load_checkpoint(path, model, optimizer, scheduler, position, history, checkpoints):
    # DCP reads what THIS rank's stages need, by name: another --pp-schedule, --dp or number of stages loads too.
    checkpoint = checkpoint_state(model, optimizer, scheduler, position, history, checkpoints)
    dcp.load(checkpoint, checkpoint_id=path)  # in place, into the tensors of `checkpoint`
    check_resume(path, checkpoint, model)  # mid-epoch: the same --dp
    set_state_dict(model, optimizer, model_state_dict=checkpoint["model"], optim_state_dict=checkpoint["optimizer"],
                   options=FLAT)
    scheduler.load_state_dict(checkpoint["scheduler"])
    position.load_state_dict(checkpoint["position"])
    history.load_state_dict(checkpoint["history"], position.epoch)


def main(argv=None):
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    parser = base_parser(LESSON, "Lesson 07: MNIST with pipeline parallelism (x FSDP2: a 2-D mesh)")
    parser.add_argument("--pp-schedule", choices=list(SCHEDULES), default="1f1b",  # --schedule: the learning rate's
                        help="the pipeline schedule: gpipe, 1f1b, interleaved (1F1B, 2 stages per rank), zb "
                             "(interleaved zero bubble, 2 stages per rank) (default: 1f1b)")
    parser.add_argument("--microbatches", type=positive_int, default=4,
                        help="micro-batches per batch: they fill the pipeline (default: 4)")
    parser.add_argument("--dp", type=positive_int, default=1,
                        help="data-parallel degree (FSDP2 across pipelines); stages = processes / dp (default: 1)")
    parser.set_defaults(blocks=4)  # Net's parameter-heavy head: layers to cut into stages
    args = parse(parser, argv)
    for flag, size in (("--batch-size", args.batch_size), ("--test-batch-size", args.test_batch_size)):
        if size % args.microbatches:  # the schedule cuts each batch into equal micro-batches
            parser.error(f"argument --microbatches: {args.microbatches} does not divide {flag} {size}: pick a "
                         f"divisor, or a {flag} that is a multiple of {args.microbatches}")
    if args.grad_accum > 1:  # step() scales ALL gradients, an earlier step's too: no accumulation over steps
        parser.error("argument --grad-accum: a pipeline accumulates its micro-batches already: use --microbatches")
    require_torch_2_10()
    checkpoints = CheckpointDir(args, LESSON, sharded=True)
    resume = checkpoints.resume_from(args.resume)  # first, before anything slow: a used --output-dir is refused

    env = launch_env()  # RANK, LOCAL_RANK, WORLD_SIZE from torchrun, or from srun's SLURM_* variables
    if env.world_size % args.dp or env.world_size // args.dp < 2:  # plain python is ONE process: no pipeline
        raise CourseError(f"--dp {args.dp} on {env.world_size} process{'es' * (env.world_size > 1)} leaves no pipeline "
                          f"of 2 stages or more: start 2 x dp processes (torchrun --nproc_per_node={2 * args.dp})")
    device = pick_device(args.device, env)  # cuda:LOCAL_RANK: the GPU is chosen by the rank WITHIN the node
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this process uses this GPU, and only this one
        torch.backends.cudnn.benchmark = True  # fixed input shapes: cuDNN times its convolutions once
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # float32 matmuls on TF32 tensor cores
    dist.init_process_group(backend=dist.get_default_backend_for_device(device),  # nccl for cuda, gloo for cpu
                            timeout=init_timeout(), rank=env.rank, world_size=env.world_size,  # at MASTER_ADDR:PORT
                            store=restart_safe_store(env), device_id=device if device.type == "cuda" else None)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # rank 0 of world_size does the writing
    stop_group = dist.new_group(backend="gloo")  # a CPU side channel for stop.agreed, next to the GPUs' NCCL
    log_all(f"host {socket.gethostname()} rank {rank}/{world_size} local_rank {env.local_rank} "
            f"device {device} backend {dist.get_backend()}")
    torch.manual_seed(args.seed)  # the same seed on every rank: identical initial weights

    train_ds, val_ds, test_ds = load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples,
                                           args.val_samples, seed=args.seed,  # the same split on every rank
                                           is_main=rank == 0, barrier=dist.barrier)  # rank 0 downloads, the rest wait
    # The mesh: rows are the stages of a pipeline, columns the data-parallel replicas of a stage (inside a node).
    mesh = init_device_mesh(device.type, (world_size // args.dp, args.dp), mesh_dim_names=("pp", "dp"))
    pp, dp, dp_rank = mesh.size(0), mesh.size(1), mesh.get_local_rank("dp")
    full_batches = len(train_ds) // (dp * args.batch_size)  # the stages' shapes are fixed: no smaller last batch
    if not full_batches:
        raise CourseError(f"--batch-size {args.batch_size} on {plural(dp, 'pipeline')} needs {dp * args.batch_size} "
                          f"training images, there are {len(train_ds)}: more --train-samples or a smaller --batch-size")
    train_ds = Subset(train_ds, range(full_batches * dp * args.batch_size))  # the same few images left out each epoch
    # Shard by DATA-PARALLEL rank: the stages of a pipeline must see the same batch.
    train_sampler = DistributedSampler(train_ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=args.seed)
    train_loader = make_loader(args, train_ds, args.batch_size, train_sampler, device)
    # EvalSampler: every image on exactly one pipeline (DistributedSampler would pad with duplicates); sums over ranks.
    val_loader = make_loader(args, val_ds, args.test_batch_size, EvalSampler(val_ds, dp, dp_rank), device) \
        if val_ds else None
    test_loader = make_loader(args, test_ds, args.test_batch_size, EvalSampler(test_ds, dp, dp_rank), device)

    amp_dtype = autocast_dtype(args.amp, device)  # --amp: bfloat16 where the device has it natively, else float16
    if amp_dtype == torch.float16:  # each stage would skip steps on its own overflows: the stages drift apart
        raise CourseError("--amp fp16 needs a GradScaler, which the stages of a pipeline do not share: use --amp bf16")
    mp_policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)  # --amp, under FSDP2
    stages, ids, count, model, total = build(args, mesh, device, amp_dtype, mp_policy)  # this rank's stages (above)
    first, last = 0 in ids, count - 1 in ids  # this rank feeds the images / computes the loss
    pp_group = mesh["pp"].get_group()  # the point-to-point sends and receives: along a pipeline
    schedule = make_schedule(args, stages, ids, count, pp_group, device, training=True)
    eval_schedule = make_schedule(args, stages, ids, count, pp_group, device, training=False)
    torch.manual_seed(args.seed + rank)  # one dropout stream per stage and replica
    log0(f"lesson 07: {world_size} process{'es' if world_size > 1 else ''}, mesh pp {pp} x dp {dp}, "
         f"{args.pp_schedule}: {plural(count, 'stage')} of {total / 1e6:,.1f} M "
         f"parameters in all, {args.microbatches} micro-batches of {args.batch_size // args.microbatches}")
    log_all(f"pp-rank {mesh.get_local_rank('pp')} holds stage{'s' * (len(ids) > 1)} "
            f"{' and '.join(map(str, ids))}: {count_parameters(model) / 1e6:,.2f} M parameters")
    optimizer = make_optimizer(args, model.parameters(), dp)  # --lr-scaling: data-parallel replicas
    scheduler = make_scheduler(args, optimizer, steps_per_epoch(train_loader, args))  # --schedule: the learning rate
    position, history = Position(), History(args, LESSON, device)
    if resume:  # --resume auto: the newest good checkpoint
        load_checkpoint(resume, model, optimizer, scheduler, position, history, checkpoints)
    save_config(args, f"{args.output_dir}/config.yaml")  # --config this file replays the run

    with StopSignals(signal.SIGINT, signal.SIGTERM, signal.SIGUSR1) as stop:  # + Slurm's warning before the limit
        for epoch in range(position.epoch, args.epochs + 1):
            train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
            train_stats = train(args, model, schedule, device, train_loader, optimizer, scheduler, position, stop,
                                stop_group, first, last)
            # a collective (all_reduce): every rank calls it
            if stop.agreed(stop_group, now=True):  # also a request after the epoch's last check: all ranks save here
                save_checkpoint(checkpoints.path(position), model, optimizer, scheduler, position, history, checkpoints)
                stop.report(position.epoch, position.step)
                break
            val_stats = test(args, model, eval_schedule, device, val_loader, first, last) if val_loader else None
            history.add(epoch, train_stats, test(args, model, eval_schedule, device, test_loader, first, last),
                        val_stats, scheduler.get_last_lr()[0])
            position.next_epoch()
            path = checkpoints.path(position)
            save_checkpoint(path, model, optimizer, scheduler, position, history, checkpoints)
            checkpoints.prune(path, best=history.best_epoch == epoch)  # the newest --keep-checkpoints, and best.pt
            if should_stop(history.rows, args.target_accuracy, args.patience):  # the target reached, or --patience
                break
        history.close()
        # a collective (all_reduce): one more vote, so a request after the last one (in the last test or save) stops
        # every rank or none: a rank that skipped the gather alone would leave the others waiting in it
        if stop.agreed(stop_group, now=True):
            stop.report(position.epoch, position.step)  # the last epoch's checkpoint is saved; said once
        else:  # one plain file for inference: every stage's full weights, gathered onto rank 0's CPU
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # FSDP2: all-gathers
            full = {k: v.cpu() for k, v in full.items()}
            pieces = [None] * world_size if rank == 0 else None
            dist.gather_object(full, pieces, dst=0)  # each stage's layers (the dp replicas send the same ones)
            if rank == 0:
                atomic_save({k: v for piece in pieces for k, v in piece.items()}, f"{args.output_dir}/model_full.pt")
        dist.destroy_process_group()  # inside the `with`: a late SIGUSR1 is written down, not the end of the process
    return history.record  # the numbers of metrics.json, e.g. for a notebook


r"""The trainer's --parallel pp: pipeline stages on the ranks of a pipeline, FSDP2 across --dp pipelines (lesson 07).

Stage 0 holds the features, fc1 and the first blocks; the last stage the other blocks, fc2 and the loss. A stage
sends its activations to the next one and gets their gradients back (point-to-point, no collective); the schedule
(--pp-schedule) orders the micro-batches' forwards and backwards, and the ranks idle while the pipeline fills and
drains: the bubble. The ranks of a pipeline read the SAME batch. From the course folder:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 trainer/train.py --parallel pp \
        --pp-schedule 1f1b --data synthetic --train-samples 6000 --test-samples 500 --epochs 2 --num-workers 0 \
        --lr 0.5
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common`
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "07_pipeline_parallel"))  # lesson 07's stages

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)
from torch.distributed.tensor import DTensor
from torch.utils.data import Subset

from common.checkpoints import CheckpointDir
from common.cli import base_parser, parse, positive_int
from common.distributed import launch_env
from common.errors import CourseError
from common.files import atomic_save, work_in_course_folder
from common.log import log0, log_all, plural
from common.metrics import EpochMeter
from common.model import Net, count_parameters, model_flags
from stages import Stage, check_resume, init_weights, replicas, stage_blocks
from torch_floor import require_torch_2_10
from trainer.amp import autocast_dtype
from trainer.data import load_data, make_loaders
from trainer.loop import Run
from trainer.process import init_distributed
from trainer.state import DCP

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


class PipelineDCP(DCP):
    """Lesson 07's DCP checkpoint: under Net's names, and (flatten) the optimizer's param groups too: the stages hold
    different layers, and DCP writes a key that several ranks have ONCE (param_groups.0.params would be one rank's
    list of names). No loss scale (float16 is refused); the number of pipelines, for a mid-epoch resume."""

    def __init__(self):
        super().__init__(options=FLAT)

    def state(self, run) -> dict:
        return {**super().state(run), "dp": replicas(run.model)}

    def check(self, path, checkpoint: dict, run) -> None:
        check_resume(path, checkpoint, run.model)  # mid-epoch: the same --dp


class PipelineRun(Run):
    """The loop of trainer/loop.py, but a step is the schedule's: stage 0 feeds the images, the last stage computes
    the loss and counts; every stage keeps its own optimizer step (no GradScaler, no --grad-accum)."""

    def __init__(self, *args, schedules, first: bool, last: bool, **kwargs):
        self.schedule, self.eval_schedule = schedules
        self.first, self.last = first, last
        super().__init__(*args, scaler=False, warm=False, **kwargs)

    def train_epoch(self) -> dict:
        """One epoch, from position.step on. Leaves early, between two steps, when a stop was requested."""
        args, device, position = self.args, self.device, self.position
        self.model.train()
        meter = position.meter(device)  # the epoch's training loss; a resumed epoch continues its own sums
        for data, target in position.remaining(self.train_loader, args):  # a resumed epoch skips its steps
            if self.stopping():  # a collective (all_reduce): the vote, every 10 steps
                break  # between two optimizer steps; the caller saves a checkpoint here
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            losses = []  # the last stage's loss of each micro-batch
            # The whole step: forwards and backwards of every micro-batch in the schedule's order, sends and
            # receives. Stage 0 gets the images, the last stage the labels; a rank with neither waits for neighbours.
            self.schedule.step(*[data] * self.first, target=target if self.last else None, losses=losses,
                               return_outputs=False)
            if args.clip_grad:  # the norm of ALL gradients: every stage's (above)
                clip_grad_norm(self.model.parameters(), args.clip_grad, device)
            self.optimizer.step()
            self.scheduler.step()  # the learning rate schedule advances once per optimizer step
            self.optimizer.zero_grad(set_to_none=True)
            position.step += 1
            if self.last:  # once per pipeline: the last stage has the losses (equal micro-batches: the batch's mean)
                meter.update(torch.stack(losses).detach().mean() * len(data), 0, len(data))  # a SUM: the mean is exact
        return meter.all_reduce()

    @torch.no_grad()
    def evaluate(self, loader) -> dict:
        args, device, first = self.args, self.device, self.first
        self.model.eval()
        meter = EpochMeter(device)
        for data, target in loader:
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            pad = args.test_batch_size - len(data)  # the stages' shapes are fixed: zeros fill a smaller batch...
            output = self.eval_schedule.eval(*[F.pad(data, (0, 0, 0, 0, 0, 0, 0, pad))] * first)
            if self.last:  # ...and only the real images count
                loss_sum = F.nll_loss(output[:len(data)].float(), target, reduction="sum")
                meter.update(loss_sum, (output[:len(data)].argmax(dim=1) == target).sum(), len(data))
        for _ in range(loader.sampler.most_batches(loader.batch_size) - len(loader)):  # FSDP gathers INSIDE forward
            self.eval_schedule.eval(*[torch.zeros(args.test_batch_size, 1, 28, 28, device=device)] * first)
        return meter.all_reduce()  # all_reduce (SUM): the last stages' numbers reach every rank


def export_stages(model, path) -> None:
    """model_full.pt: every stage's full weights, gathered onto rank 0's CPU."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # FSDP2: all-gathers
    full = {k: v.cpu() for k, v in full.items()}
    pieces = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(full, pieces, dst=0)  # each stage's layers (the dp replicas send the same ones)
    if dist.get_rank() == 0:
        atomic_save({k: v for piece in pieces for k, v in piece.items()}, path)


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
    device, _, stop_group = init_distributed(args)  # the same seed on every rank: identical initial weights
    rank, world_size = dist.get_rank(), dist.get_world_size()  # rank 0 of world_size does the writing

    train_ds, val_ds, test_ds = load_data(args)
    # The mesh: rows are the stages of a pipeline, columns the data-parallel replicas of a stage (inside a node).
    mesh = init_device_mesh(device.type, (world_size // args.dp, args.dp), mesh_dim_names=("pp", "dp"))
    pp, dp, dp_rank = mesh.size(0), mesh.size(1), mesh.get_local_rank("dp")
    full_batches = len(train_ds) // (dp * args.batch_size)  # the stages' shapes are fixed: no smaller last batch
    if not full_batches:
        raise CourseError(f"--batch-size {args.batch_size} on {plural(dp, 'pipeline')} needs {dp * args.batch_size} "
                          f"training images, there are {len(train_ds)}: more --train-samples or a smaller --batch-size")
    train_ds = Subset(train_ds, range(full_batches * dp * args.batch_size))  # the same few images left out each epoch
    # Shard by DATA-PARALLEL rank: the stages of a pipeline must see the same batch.
    loaders = make_loaders(args, device, train_ds, val_ds, test_ds, replicas=dp, replica=dp_rank)
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
    run = PipelineRun(args, LESSON, device, model, loaders, checkpoints, PipelineDCP(), resume, replicas=dp,
                      stop_group=stop_group, schedules=(schedule, eval_schedule), first=first, last=last)
    return run.fit(export=lambda: export_stages(model, f"{args.output_dir}/model_full.pt"))

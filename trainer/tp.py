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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common`

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from common.checkpoints import CheckpointDir
from common.cli import base_parser, parse, positive_int
from common.distributed import launch_env
from common.errors import CourseError
from common.files import work_in_course_folder
from common.log import log0, plural
from common.model import Net, count_parameters, model_flags
from trainer.amp import autocast_dtype
from trainer.data import load_data, make_loaders
from trainer.fsdp2 import init_weights, no_sync, shard
from trainer.loop import Run
from trainer.process import init_distributed
from trainer.state import DCP, export_full

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
    return shard(model, mesh["dp"], mp_policy)  # FSDP2 as in lesson 05, cut again over "dp": 1/(dp x tp) of a block


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
    device, _, stop_group = init_distributed(args)  # the same seed on every rank: identical initial weights
    world_size = dist.get_world_size()
    # The mesh: rows are data-parallel replicas, columns the ranks of a TP group (neighbours: inside a node).
    mesh = init_device_mesh(device.type, (world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp, dp_rank, tp_rank = mesh.size(0), mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    # Shard by DATA-PARALLEL rank: the ranks of a TP group must see the same batch, each computing a slice of it.
    loaders = make_loaders(args, device, *load_data(args), replicas=dp, replica=dp_rank)
    amp_dtype = autocast_dtype(args.amp, device)  # --amp: bfloat16 where the device has it natively, else float16
    with torch.device("meta"):  # shapes only, no memory and no values: no rank ever holds the whole model
        model = TPNet(**model_flags(args))
    # --amp: bf16 or fp16 gathers and compute, fp32 gradient reduction and master shards. The GradScaler works on
    # the sharded gradients as they are: DTensor all-reduces its inf/NaN check, so every rank skips the same steps.
    parallelize(model, mesh, MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32))
    model.to_empty(device=device)  # this rank's shards, allocated, not initialised
    init_weights(model, args, TPNet)  # the values TPNet draws with --seed, one module at a time (trainer/fsdp2.py)
    if args.compile:
        model.compile(backend=args.compile)  # torch.compile in place, after fully_shard
    torch.manual_seed(args.seed + dp_rank)  # one stream per TP group: TP peers draw the SAME dropout masks
    log0(f"lesson 06: {world_size} process{'es' if world_size > 1 else ''}, mesh dp {dp} x tp {args.tp}, "
         f"{count_parameters(model) / 1e6:,.1f} M parameters: each block cut in {plural(world_size, 'piece')}, "
         f"the rest in {plural(dp, 'piece')}")
    run = Run(args, lesson, device, model, loaders, checkpoints, DCP(), resume, replicas=dp, amp_dtype=amp_dtype,
              stop_group=stop_group, no_sync=lambda: no_sync(model), clip_grad_norm=clip_grad_norm,
              counted=tp_rank == 0, join=True)  # the TP peers' numbers count once
    return run.fit(export=lambda: export_full(model, f"{args.output_dir}/model_full.pt"))

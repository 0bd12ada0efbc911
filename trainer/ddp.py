r"""The trainer's --parallel ddp: DistributedDataParallel, one process per GPU or CPU slot (lesson 04).

Every process holds a full replica, trains on its own shard of the data, and DDP all_reduces
the gradients during backward, so all replicas take the same optimizer step. From the course folder:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 trainer/train.py --parallel ddp --data synthetic \
        --train-samples 4000 --test-samples 1000 --epochs 2 --num-workers 0
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common`

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.checkpoints import CheckpointDir
from common.cli import base_parser, parse
from common.errors import CourseError
from common.exits import out_of_memory_advice
from common.files import work_in_course_folder
from common.log import log0
from common.model import Net, model_flags
from trainer.amp import autocast_dtype
from trainer.data import load_data, make_loaders
from trainer.loop import Run
from trainer.process import init_distributed
from trainer.state import TorchSave

LESSON = "trainer-ddp"  # the checkpoints' signature, and the default runs/trainer-ddp


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

    device, _, stop_group = init_distributed(args)  # the same seed on every rank: identical initial weights
    rank, world_size = dist.get_rank(), dist.get_world_size()  # rank 0 of world_size does the writing
    if args.sync_bn and device.type != "cuda":
        raise CourseError("--sync-bn needs GPUs (SyncBatchNorm only works with CUDA modules): drop it on CPU")
    # Shard by GLOBAL rank: with the local rank, every node would train on the same shard.
    loaders = make_loaders(args, device, *load_data(args), replicas=world_size, replica=rank)
    amp_dtype = autocast_dtype(args.amp, device)  # --amp: bfloat16 where the device has it natively, else float16
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
    return Run(args, LESSON, device, model, loaders, checkpoints, TorchSave(), resume, replicas=world_size,
               amp_dtype=amp_dtype, stop_group=stop_group,
               no_sync=model.no_sync if world_size > 1 else None).fit()  # DDP's no_sync(): no all_reduce yet

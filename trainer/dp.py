r"""The trainer's --parallel dp: nn.DataParallel, one process driving every visible GPU (lesson 03).

Each batch is split across the GPUs, replicas of the model run the pieces in threads, and the
outputs and gradients are gathered back on GPU 0. Easy to add, slow to scale (03_dp_training/README.md).
From the course folder:
    python trainer/train.py --parallel dp --train-samples 4000 --test-samples 1000 \
        --epochs 1 --num-workers 0
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common`

import torch
import torch.nn as nn

from common.checkpoints import CheckpointDir
from common.cli import base_parser, parse
from common.files import work_in_course_folder
from common.log import log0
from common.model import Net, model_flags
from trainer.amp import autocast_dtype
from trainer.data import load_data, make_loaders
from trainer.loop import Run
from trainer.process import one_device
from trainer.state import TorchSave

LESSON = "trainer-dp"  # the checkpoints' signature, and the default runs/trainer-dp


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
    device = one_device(args, benchmark=False)  # DP's threads are new at every step: cuDNN would autotune at each
    n_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    log0(f"lesson 03: 1 process, nn.DataParallel over {n_gpus} GPUs, {args.batch_size // max(n_gpus, 1)} images each"
         if n_gpus > 1 else f"lesson 03: DataParallel needs 2+ GPUs and does nothing on {device}: one process")
    log0(describe_gpu_paths(n_gpus))  # DataParallel copies to and from GPU 0 at every step
    resume = checkpoints.resume_from(args.resume)  # before anything slow: a used --output-dir is refused

    loaders = make_loaders(args, device, *load_data(args))
    amp_dtype = autocast_dtype(args.amp, device)  # --amp: bfloat16 where the device has it natively, else float16
    model = Net(**model_flags(args)).to(device)  # the master copy lives on GPU 0 (cuda:0)
    if args.compile:
        model.compile(backend=args.compile)  # torch.compile in place: state_dict keys stay the same
    model = nn.DataParallel(model)  # --batch-size is split across the GPUs at every step (on CPU: a no-op)
    return Run(args, LESSON, device, model, loaders, checkpoints, TorchSave(), resume, amp_dtype=amp_dtype).fit()

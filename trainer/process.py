"""Where a run computes: one device (single, dp), or one process per GPU or CPU slot in a process group (torchrun or
srun: ddp, fsdp2, tp, 2d, pp): the device, torch.distributed.init_process_group, and the group of the stop votes."""
import socket

import torch
import torch.distributed as dist

from common.distributed import init_timeout, launch_env, pick_device, restart_safe_store
from common.log import log_all


def set_up_cuda(device, benchmark: bool = True) -> None:
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = benchmark  # fixed input shapes: cuDNN times its convolutions once
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # float32 matmuls on TF32 tensor cores


def one_device(args, benchmark: bool = True) -> torch.device:
    """single and dp: cuda if there is a GPU, else cpu."""
    device = pick_device(args.device)
    set_up_cuda(device, benchmark)
    torch.manual_seed(args.seed)
    return device


def init_distributed(args):
    """The process group of every rank, and (device, env, stop_group): a gloo group for the stop votes."""
    env = launch_env()  # RANK, LOCAL_RANK, WORLD_SIZE from torchrun, or from srun's SLURM_* variables
    device = pick_device(args.device, env)  # cuda:LOCAL_RANK: the GPU is chosen by the rank WITHIN the node
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this process uses this GPU, and only this one
    set_up_cuda(device)
    dist.init_process_group(backend=dist.get_default_backend_for_device(device),  # nccl for cuda, gloo for cpu
                            timeout=init_timeout(), rank=env.rank, world_size=env.world_size,  # meet at MASTER_ADDR:PORT
                            store=restart_safe_store(env), device_id=device if device.type == "cuda" else None)
    stop_group = dist.new_group(backend="gloo")  # a CPU side channel for stop.agreed, next to the GPUs' NCCL
    log_all(f"host {socket.gethostname()} rank {dist.get_rank()}/{dist.get_world_size()} "
            f"local_rank {env.local_rank} device {device} backend {dist.get_backend()}")
    torch.manual_seed(args.seed)  # the same seed on every rank: identical initial weights
    return device, env, stop_group

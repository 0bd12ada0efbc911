"""Lesson 01: is this environment ready for the course? Prints versions, devices and a verdict.

    python check_env.py          # on your laptop, on a login node, or inside a Slurm job
"""
import os
import platform
import sys

import torch
import torch.distributed as dist
import torchvision

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
              "SLURM_CPUS_PER_TASK", "SLURM_GPUS_ON_NODE", "CUDA_VISIBLE_DEVICES")


def main() -> int:
    print(f"python       {sys.version.split()[0]} ({platform.node()})")
    print(f"torch        {torch.__version__}")
    print(f"torchvision  {torchvision.__version__}")
    print(f"CUDA build   {torch.version.cuda or 'none (CPU-only build)'}")
    print(f"gloo         {'available' if dist.is_gloo_available() else 'MISSING'}")
    nccl = dist.is_nccl_available()
    print(f"nccl         {'compiled in, version ' + '.'.join(map(str, torch.cuda.nccl.version())) if nccl else 'not available'}")
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"GPUs         {n_gpus}")
    for i in range(n_gpus):
        props = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i}     {props.name}, {props.total_memory / 2**30:.0f} GiB")
    slurm = {k: os.environ[k] for k in SLURM_VARS if k in os.environ}
    for key, value in slurm.items():
        print(f"{key:<22} {value}")

    problems = []
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 9):
        problems.append(f"torch {torch.__version__} is older than 2.9, which the lessons need: upgrade it")
    if not dist.is_gloo_available():
        problems.append("gloo is missing: reinstall torch")
    if n_gpus and not nccl:
        problems.append("GPUs but no NCCL: install a CUDA build of torch")
    if problems:
        print("verdict: NOT READY -", "; ".join(problems))
        return 1
    where = f"{n_gpus} GPU(s) with NCCL" if n_gpus else "CPU only, gloo (lessons run; GPU numbers need a GPU node)"
    print(f"verdict: READY - {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

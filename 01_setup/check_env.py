"""Lesson 01: is this environment ready for the course? Prints versions, devices and a verdict.

From the course folder, on your laptop, on a login node, or inside a Slurm job:
    python 01_setup/check_env.py
    python 01_setup/check_env.py --device cpu   # a GPU job that will train on the CPU on purpose
On a GPU node it checks what makes GPUs unusable: a CPU-only build of torch, a driver too old for the wheel's
CUDA, a GPU the wheel has no kernels for (docs/install.md). Each problem is one `NOT READY:` line with its fix,
and the exit code is 1.
"""
import os
import platform
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install

import torch
import torch.distributed as dist
import torchvision

from common.cli import Parser
from common.exits import run
from common.files import work_in_course_folder
from common.gpus import LAST_LEGACY, LEGACY_INDEX, has_native_bf16, nvidia_smi, pip_line, slurm_gpus, why_no_gpu

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
              "SLURM_CPUS_PER_TASK", "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES")
CUDA13_INDEX = "https://download.pytorch.org/whl/cu130"  # Turing to Blackwell, driver >= 580


def has_kernels(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Does this torch run on a GPU of this compute capability? Machine code for sm_XY runs on the same major
    version at the same or a higher minor; PTX (compute_XY) is compiled at load time for any newer GPU."""
    cc = 10 * capability[0] + capability[1]
    for arch in arch_list:
        m = re.match(r"(sm|compute)_(\d+)", arch)
        if m and int(m[2]) <= cc and (m[1] == "compute" or int(m[2]) // 10 == capability[0]):
            return True
    return False


def wheel_for(capability: tuple[int, int]) -> str:
    """The fix for a GPU this torch has no kernels for: which wheel has them, and for how long."""
    if capability < (5, 0):
        return "no current PyTorch wheel supports it: use a newer GPU"
    if capability < (7, 5):
        return (f"install the CUDA 12.6 wheel, the last for GPUs older than Turing: {pip_line(LEGACY_INDEX)}; "
                f"no PyTorch after {'.'.join(map(str, LAST_LEGACY))} will have one (pytorch/pytorch#190385)")
    return f"install a CUDA 13 wheel (needs driver >= 580): {pip_line(CUDA13_INDEX)}"


def gpu_problems(device: str) -> tuple[list[str], list[str]]:
    """Print the driver and one line per GPU; return (problems, notes) about the GPUs, each one line with its fix."""
    smi_gpus, smi_problem = nvidia_smi()
    driver = smi_gpus[0].driver if smi_gpus else None
    print(f"driver       {driver + f' (nvidia-smi lists {len(smi_gpus)} GPU(s))' if driver else f'none ({smi_problem})'}")
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"GPUs         {n_gpus}{f' visible to torch; nvidia-smi lists {len(smi_gpus)}' if smi_gpus and not n_gpus else ''}")
    # (index, name, compute capability, where): torch's GPUs, else those only nvidia-smi can see
    gpus = [(i, torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i), f"cuda:{i}") for i in range(n_gpus)]
    gpus = gpus or [(g.index, g.name + " (torch cannot use it)", g.capability, f"gpu {g.index}") for g in smi_gpus]
    for i, name, cap, where in gpus:
        memory = f", {torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB" if n_gpus else ""
        arch = f"sm_{cap[0]}{cap[1]}, bfloat16 native: {'yes' if has_native_bf16(cap) else 'no'}" if cap else \
            "compute capability unknown"
        print(f"  {where:<10} {name}{memory}, {arch}, driver {driver or 'unknown'}")

    findings, allocated = [], slurm_gpus()
    if not n_gpus and (allocated or smi_gpus or device == "cuda"):
        who = (f"Slurm gave this job GPUs ({allocated})" if allocated else
               f"nvidia-smi lists {len(smi_gpus)} GPU(s)" if smi_gpus else "--device cuda asks for a GPU")
        findings.append(f"{who} but torch sees none: {why_no_gpu(smi_gpus, smi_problem)}")
    arch_list = torch.cuda.get_arch_list()
    for i, name, cap, where in gpus:
        if cap and torch.version.cuda and not has_kernels(cap, arch_list):
            findings.append(f"GPU {i} ({name}) is sm_{cap[0]}{cap[1]}, but this torch has kernels for "
                            f"{' '.join(arch_list)} only: {wheel_for(cap)}")
    return ([], findings) if device == "cpu" else (findings, [])


def main(argv=None) -> int:
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    parser = Parser(description="Is this environment ready for the course? Versions, devices, and a verdict")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="cpu: the lessons will run on the CPU here, GPUs or not; cuda: a GPU is required "
                             "(default: auto, a GPU wherever Slurm or nvidia-smi says there is one)")
    args = parser.parse_args(argv)
    print(f"python       {sys.version.split()[0]} ({platform.node()})")
    print(f"torch        {torch.__version__}")
    print(f"torchvision  {torchvision.__version__}")
    kernels = f", kernels for {' '.join(torch.cuda.get_arch_list())}" if torch.version.cuda else ""
    print(f"CUDA build   {torch.version.cuda or 'none (CPU-only build)'}{kernels}")
    print(f"gloo         {'available' if dist.is_gloo_available() else 'MISSING'}")
    nccl = dist.is_nccl_available()
    print(f"nccl         {'compiled in, version ' + '.'.join(map(str, torch.cuda.nccl.version())) if nccl else 'not available'}")
    problems, notes = gpu_problems(args.device)
    for key, value in ((k, os.environ[k]) for k in SLURM_VARS if k in os.environ):
        print(f"{key:<22} {value}")

    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 9):
        problems.append(f"torch {torch.__version__} is older than 2.9, which the lessons need: upgrade it")
    if not dist.is_gloo_available():
        problems.append("gloo is missing: reinstall torch")
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpus and not nccl:
        problems.append("GPUs but no NCCL: install a CUDA build of torch")
    for note in notes:
        print(f"note (--device cpu): {note}")
    for problem in problems:
        print(f"NOT READY: {problem}")
    if problems:
        print(f"verdict: NOT READY ({len(problems)} problem{'s' if len(problems) > 1 else ''} above)")
        return 1
    where = f"{n_gpus} GPU(s) with NCCL" if n_gpus and args.device != "cpu" else \
        "CPU only, gloo (lessons run; GPU numbers need a GPU node)"
    print(f"verdict: READY - {where}")
    return 0


if __name__ == "__main__":
    run(lambda argv: sys.exit(main(argv)))  # exit 1 when NOT READY; a mistyped flag: one `error:` line, exit 2

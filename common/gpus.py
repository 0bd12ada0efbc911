"""Which GPUs this node has, and why torch may be unable to use them: for 01_setup/check_env.py and pick_device.

The facts (sources in docs/install.md#which-wheel-for-which-gpu-and-driver): CUDA 13.x needs driver >= 580, 12.x
>= 525; the CUDA 13 wheels run on Turing (sm_75) and newer, the CUDA 12.6 ones also on Maxwell to Volta; 2.14 is the
last release with CUDA 12.6 wheels.
"""
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

import torch

MIN_DRIVER = {12: (525,), 13: (580,)}  # CUDA major version of the wheel -> the oldest driver that runs it
LEGACY_INDEX = "https://download.pytorch.org/whl/cu126"  # the CUDA 12.6 wheels: Maxwell to Hopper, driver >= 525
LAST_LEGACY = (2, 14)  # the last PyTorch release with a CUDA 12.6 wheel (pytorch/pytorch#190385)


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi lists it: it answers even when torch cannot use the GPU."""
    index: int
    name: str
    capability: tuple[int, int] | None  # None: a driver too old to report it
    driver: str


def numbers(text: str) -> tuple[int, ...]:
    """'535.104.05' -> (535, 104, 5); '2.14.1+cu130' -> (2, 14, 1): compare versions as numbers, not strings."""
    return tuple(int(n) for n in re.findall(r"\d+", text.split("+")[0]))


def slurm_gpus(environ=None) -> str | None:
    """`NAME=value` of the first variable by which Slurm says this job has GPUs, else None."""
    env = os.environ if environ is None else environ
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES"):
        if name == "CUDA_VISIBLE_DEVICES" and "SLURM_JOB_ID" not in env:
            continue  # outside a job it is the user's own choice, not an allocation
        value = env.get(name, "").strip()
        none = ("", "NoDevFiles", "-1") + (("0",) if name == "SLURM_GPUS_ON_NODE" else ())  # that one is a count
        if value not in none:
            return f"{name}={value}"
    return None


def nvidia_smi() -> tuple[list[Gpu], str]:
    """(the GPUs nvidia-smi lists, '') or ([], why it lists none). Older drivers do not know `compute_cap`."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [], "nvidia-smi not found"
    for fields in ("index,name,driver_version,compute_cap", "index,name,driver_version"):
        try:
            done = subprocess.run([exe, f"--query-gpu={fields}", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return [], f"nvidia-smi failed: {exc}"
        if done.returncode == 0:
            break
    else:
        said = (done.stdout + done.stderr).strip().splitlines()
        return [], f"nvidia-smi: {said[0] if said else f'exit code {done.returncode}'}"
    gpus = []
    for line in done.stdout.strip().splitlines():
        index, name, driver, *cap = [part.strip() for part in line.split(",")]
        major_minor = numbers(cap[0]) if cap else ()
        gpus.append(Gpu(int(index), name, major_minor[:2] if len(major_minor) >= 2 else None, driver))
    return gpus, "" if gpus else "nvidia-smi lists no GPU"


def has_native_bf16(capability: tuple[int, int]) -> bool:
    """torch.cuda.is_bf16_supported(including_emulation=False)'s test (Ampere, 8.0, or newer), for any GPU's capability,
    also one torch cannot use."""
    return capability[0] >= 8


def pip_line(index: str) -> str:
    """pip install of this torch (and torchvision) from another wheel index; 2.14 at most for the CUDA 12.6 one."""
    import torchvision
    if index == LEGACY_INDEX and numbers(torch.__version__)[:2] > LAST_LEGACY:
        pins = "'torch==2.14.*' 'torchvision==0.29.*'"
    else:
        pins = f"torch=={torch.__version__.split('+')[0]} torchvision=={torchvision.__version__.split('+')[0]}"
    return f"pip install --force-reinstall {pins} --index-url {index}"


def driver_problem(gpus: list[Gpu]) -> str | None:
    """Why the driver cannot run this torch's CUDA, with the fix; None when it can (or no GPU or no CUDA build)."""
    if not gpus or torch.version.cuda is None:
        return None
    driver, cuda = gpus[0].driver, torch.version.cuda
    need = MIN_DRIVER.get(numbers(cuda)[0])
    if need is None or numbers(driver) >= need:
        return None
    fix = (f"install the CUDA 12.6 wheel, which runs on drivers >= 525: {pip_line(LEGACY_INDEX)}"
           if numbers(driver) >= MIN_DRIVER[12] and all(g.capability is None or g.capability <= (9, 0) for g in gpus)
           else "ask the admins for a newer driver")
    return (f"the NVIDIA driver {driver} is too old for this torch's CUDA {cuda}, which needs "
            f"{'.'.join(map(str, need))} or newer: {fix}")


def why_no_gpu(gpus: list[Gpu], smi_problem: str) -> str:
    """Why torch sees no GPU although the node (or Slurm) says it has some, with the fix."""
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None): install a CUDA wheel "
                "(docs/install.md)")
    if not gpus:
        return (f"no NVIDIA driver answers here ({smi_problem}): a node without GPUs, or a container started "
                "without --nv")
    return driver_problem(gpus) or (
        f"nvidia-smi lists {len(gpus)} GPU(s) (driver {gpus[0].driver}) but torch.cuda.is_available() is False: "
        f"check CUDA_VISIBLE_DEVICES ({os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}) and torch's warning above")

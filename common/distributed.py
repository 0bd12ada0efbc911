"""Launcher plumbing: turn what torchrun or srun tells a process into what init_process_group reads.

The lessons call torch.distributed themselves; this module only translates and checks. Three launch styles:
  torchrun (or any env:// launcher)  RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT
  srun, one task per GPU             SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_JOB_NODELIST
  a plain `python script.py`         one process
"""
import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.errors import CourseError
from common.gpus import nvidia_smi, slurm_gpus, why_no_gpu
from common.hostlist import expand_hostlist


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process about its place in the job."""
    launcher: str  # "torchrun", "slurm" or "single"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str | None = None
    master_port: int | None = None


def _int(env, name: str, default: int | None = None) -> int | None:
    if name not in env:
        return default
    try:
        return int(env[name])
    except ValueError:
        raise CourseError(f"{name}={env[name]!r} is not an integer: unset it or fix the launcher") from None


def _check_ranks(rank: int, world_size: int, source: str) -> None:
    if world_size < 1:
        raise CourseError(f"{source} world size is {world_size}: it must be at least 1")
    if not 0 <= rank < world_size:
        raise CourseError(f"{source} rank {rank} is outside 0..{world_size - 1}: "
                          "the rank must be smaller than the world size")


def slurm_master_port(job_id: int) -> int:
    """A port in 20000-39999 derived from the job id, so jobs sharing a node do not clash."""
    return 20000 + job_id % 20000


def detect_launch(environ=None) -> LaunchEnv:
    """Read the environment variables that torchrun or Slurm set; raise CourseError when they contradict."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        if "WORLD_SIZE" in env and "RANK" not in env:
            raise CourseError("WORLD_SIZE is set but RANK is not: launch with torchrun, "
                              "or export RANK too (or unset WORLD_SIZE for one process)")
        if "RANK" in env and "WORLD_SIZE" not in env:
            raise CourseError("RANK is set but WORLD_SIZE is not: launch with torchrun, or export WORLD_SIZE too")
        rank, world_size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        _check_ranks(rank, world_size, "torchrun/env")
        local_world_size = _int(env, "LOCAL_WORLD_SIZE", world_size)
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank % local_world_size
        return LaunchEnv("torchrun", rank, local_rank, world_size, local_world_size, env.get("MASTER_ADDR"),
                         _int(env, "MASTER_PORT"))

    # srun sets SLURM_STEP_NUM_TASKS for its step; the batch script itself only has SLURM_NTASKS.
    ntasks_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    if "SLURM_PROCID" in env and ntasks_var in env:
        rank, world_size = _int(env, "SLURM_PROCID"), _int(env, ntasks_var)
        _check_ranks(rank, world_size, "Slurm")
        local_rank = _int(env, "SLURM_LOCALID", 0)
        tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
        local_world_size = int(tasks_per_node.split("(")[0].split(",")[0])
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        addr = env.get("MASTER_ADDR") or (expand_hostlist(nodelist)[0] if nodelist else "127.0.0.1")
        port = _int(env, "MASTER_PORT") or slurm_master_port(_int(env, "SLURM_JOB_ID", 0))
        return LaunchEnv("slurm", rank, local_rank, world_size, local_world_size, addr, port)

    return LaunchEnv("single", 0, 0, 1, 1)


def free_port() -> int:
    """Ask the OS for a free TCP port on this machine (MASTER_PORT of a plain `python script.py`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(environ=None) -> LaunchEnv:
    """detect_launch(), then export what init_process_group's env:// reads (srun sets only SLURM_* names)."""
    env = os.environ if environ is None else environ
    launch = detect_launch(env)
    env.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size), LOCAL_RANK=str(launch.local_rank),
               LOCAL_WORLD_SIZE=str(launch.local_world_size))
    env.setdefault("MASTER_ADDR", launch.master_addr or "127.0.0.1")
    env.setdefault("MASTER_PORT", str(launch.master_port or free_port()))
    return launch


def pick_device(requested: str = "auto", launch: LaunchEnv | None = None) -> torch.device:
    """auto: a GPU if there is one, else the CPU, but never unnoticed in a Slurm job that has GPUs torch cannot use.
    Which GPU comes from the LOCAL rank, never the global one."""
    launch = launch or LaunchEnv("single", 0, 0, 1, 1)
    if requested != "cpu" and not torch.cuda.is_available() and (allocated := slurm_gpus()):
        # A GPU job must not train on the CPU unnoticed (10-50x slower): stop, and say why torch sees no GPU.
        raise CourseError(f"Slurm gave this job GPUs ({allocated}) but torch cannot use them: "
                          f"{why_no_gpu(*nvidia_smi())}; details: python 01_setup/check_env.py "
                          "(--device cpu runs on the CPU anyway)")
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise CourseError("--device cuda but no CUDA GPU is visible: run on a GPU node or use --device cpu")
    n_gpus = torch.cuda.device_count()
    if launch.launcher == "slurm" and n_gpus == 1:
        index = 0  # srun --gpus-per-task=1 (or --gpu-bind): this task's own GPU is cuda:0, Slurm hid the others
    elif launch.local_rank < n_gpus and launch.local_world_size <= n_gpus:
        index = launch.local_rank
    else:
        raise CourseError(f"{launch.local_world_size} processes on this node but only {n_gpus} GPU(s) visible: "
                          f"start at most {n_gpus} per node (--nproc_per_node / --gpus-per-node / --ntasks-per-node)")
    return torch.device("cuda", index)


def init_timeout() -> datetime.timedelta:
    """How long a collective may wait for the slowest rank before it fails: $DIST_TIMEOUT_SECONDS or 600 s."""
    return datetime.timedelta(seconds=float(os.environ.get("DIST_TIMEOUT_SECONDS", 600)))


def restart_safe_store(launch: LaunchEnv):
    """None (init_process_group reads env://), or under torchrun a store with a fresh key space per attempt: torchrun
    keeps ONE store across --max-restarts, and a restarted group could read the addresses of the processes that died."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    store, _, _ = next(dist.rendezvous("env://", launch.rank, launch.world_size, timeout=init_timeout()))
    return dist.PrefixStore(f"attempt_{attempt}", store)


def get_rank() -> int:
    """The global rank; before init_process_group, what the launcher said (RANK, else SLURM_PROCID, else 0)."""
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main_process() -> bool:
    """True on global rank 0, and in a plain single process."""
    return get_rank() == 0


def barrier() -> None:
    """dist.barrier() when there is a process group; nothing in a single process."""
    if dist.is_initialized():
        dist.barrier()

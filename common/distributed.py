"""Process-group plumbing: how were we launched, which device and backend, init and cleanup.

Three launch styles are recognised, in this order:
  torchrun (or any env:// launcher)  RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE
  srun, one task per GPU             SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS
  a plain `python script.py`         one process, no process group needed
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.errors import CourseError
from common.hostlist import expand_hostlist

DEFAULT_TIMEOUT_S = 600


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


def _int(env, name: str) -> int:
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
        local_world_size = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world_size
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank % local_world_size
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
        return LaunchEnv("torchrun", rank, local_rank, world_size, local_world_size,
                         env.get("MASTER_ADDR"), port)

    # srun sets SLURM_STEP_NUM_TASKS for its step; the batch script itself only has SLURM_NTASKS.
    ntasks_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    if "SLURM_PROCID" in env and ntasks_var in env:
        rank, world_size = _int(env, "SLURM_PROCID"), _int(env, ntasks_var)
        _check_ranks(rank, world_size, "Slurm")
        local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
        local_world_size = int(tasks_per_node.split("(")[0].split(",")[0])
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        addr = env.get("MASTER_ADDR") or (expand_hostlist(nodelist)[0] if nodelist else "127.0.0.1")
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT")
        else:
            port = slurm_master_port(_int(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0)
        return LaunchEnv("slurm", rank, local_rank, world_size, local_world_size, addr, port)

    return LaunchEnv("single", 0, 0, 1, 1)


def resolve_device(requested: str, local_rank: int, local_world_size: int = 1) -> torch.device:
    """auto -> cuda:LOCAL_RANK when CUDA is there, else cpu. Global rank never picks the GPU."""
    if requested not in ("auto", "cpu", "cuda"):
        raise CourseError(f"unknown device {requested!r}: use auto, cpu or cuda")
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise CourseError("--device cuda but no CUDA GPU is visible: run on a GPU node or use --device cpu")
    n_gpus = torch.cuda.device_count()
    if local_rank >= n_gpus or local_world_size > n_gpus:
        raise CourseError(f"{local_world_size} processes on this node but only {n_gpus} GPU(s) visible: "
                          f"start at most {n_gpus} per node (--nproc_per_node / --gpus-per-node / --ntasks-per-node)")
    return torch.device("cuda", local_rank)


def resolve_backend(requested: str | None, device: torch.device) -> str:
    """nccl for GPUs, gloo for CPUs; an explicit choice wins if it can work."""
    backend = requested or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise CourseError("backend nccl needs CUDA GPUs: use gloo on CPU (or run on a GPU node)")
    if backend not in ("nccl", "gloo"):
        raise CourseError(f"unknown backend {backend!r}: use nccl (GPUs) or gloo (CPU)")
    return backend


def free_port() -> int:
    """Ask the OS for a free TCP port on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class DistContext:
    """Everything a training script needs to know about the process group it is in."""
    launch: LaunchEnv
    device: torch.device
    backend: str | None  # None when no process group was started
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_distributed(self) -> bool:
        return self.backend is not None

    @property
    def master_process(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        barrier()

    def __enter__(self) -> "DistContext":
        return self

    def __exit__(self, *exc) -> None:
        cleanup()


_current: DistContext | None = None


def setup(use_distributed: str = "auto", device: str = "auto", backend: str | None = None,
          timeout_s: float | None = None, environ=None) -> DistContext:
    """Detect the launch, pick device/backend, start the process group. Calling it twice is harmless.

    use_distributed: "auto" starts a process group only when world size > 1; "on" always does
    (a group of one works too, e.g. FSDP on one GPU); "off" never does.
    """
    global _current
    if _current is not None and (dist.is_initialized() or not _current.is_distributed):
        return _current
    if use_distributed not in ("auto", "on", "off"):
        raise CourseError(f"use_distributed={use_distributed!r}: use auto, on or off")
    env = os.environ if environ is None else environ
    launch = detect_launch(env)
    if use_distributed == "off" and launch.world_size > 1:
        raise CourseError(f"distributed is off but the launcher started {launch.world_size} processes: "
                          "launch one process or turn distributed on")
    dev = resolve_device(device, launch.local_rank, launch.local_world_size)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # before init, so NCCL and barrier() use this rank's GPU
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN time and pick its fastest convs
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 tensor cores for fp32 matmuls (Ampere and newer)
    want_group = use_distributed == "on" or (use_distributed == "auto" and launch.world_size > 1)
    if not want_group:
        _current = DistContext(launch, dev, None)
        return _current

    chosen = resolve_backend(backend or env.get("DIST_BACKEND"), dev)
    if timeout_s is None:
        timeout_s = float(env.get("DIST_TIMEOUT_SECONDS", DEFAULT_TIMEOUT_S))
    # torchrun exports MASTER_ADDR/PORT itself; for srun and single processes we export them for env://.
    os.environ.setdefault("MASTER_ADDR", launch.master_addr or "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(launch.master_port or free_port()))
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None
    if "TORCHELASTIC_RESTART_COUNT" in env:
        # torchrun keeps one key-value store across restarts: give each attempt its own keys,
        # or a restarted group would read the addresses of the processes that died.
        store, _, _ = next(dist.rendezvous("env://", launch.rank, launch.world_size, timeout=timeout))
        store = dist.PrefixStore(f"attempt_{env['TORCHELASTIC_RESTART_COUNT']}", store)
    try:
        dist.init_process_group(
            backend=chosen,
            init_method=None if store else "env://",
            store=store,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
            device_id=dev if dev.type == "cuda" else None,  # binds NCCL to this GPU up front
        )
    except RuntimeError as exc:
        if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
            port = os.environ["MASTER_PORT"]
            raise CourseError(f"MASTER_PORT {port} is already in use on {os.environ['MASTER_ADDR']}: pick another, "
                              f"e.g. MASTER_PORT={free_port()} (torchrun: --master_port or --rdzv_endpoint)") from None
        raise
    _current = DistContext(launch, dev, chosen, launch.rank, launch.local_rank, launch.world_size)
    return _current


def cleanup() -> None:
    """Destroy the process group if there is one. Safe to call any number of times."""
    global _current
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = None


def barrier() -> None:
    """Wait for every rank; a no-op in a single process. NCCL is told the GPU so it need not guess."""
    if dist.is_initialized():
        on_gpu = dist.get_backend() == "nccl"
        dist.barrier(device_ids=[torch.cuda.current_device()] if on_gpu else None)


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main_process() -> bool:
    """True on global rank 0, and in a plain single process."""
    return get_rank() == 0

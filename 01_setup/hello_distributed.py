"""Lesson 01: the four collectives every distributed training job uses, each CHECKED.

From the course folder (01_setup/README.md):
    python 01_setup/hello_distributed.py                                                     # one process
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 01_setup/hello_distributed.py # four on this machine
    srun --nodes=1 --ntasks-per-node=2 --gpus-per-node=2 python 01_setup/hello_distributed.py  # Slurm: 1 task/GPU
Exits 0 and prints "OK" on rank 0 only if every result is what the maths says it must be.
"""
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install

import torch
import torch.distributed as dist

from common.cli import Parser
from common.distributed import init_timeout, launch_env, pick_device, restart_safe_store
from common.exits import run
from common.files import work_in_course_folder
from common.log import write_line


def main(argv=None):
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    parser = Parser(description="Check all_reduce, broadcast, all_gather and barrier on every rank")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: cuda:LOCAL_RANK if there are GPUs, else the CPU; cpu: the CPU even in a GPU job")
    args = parser.parse_args(argv)
    env = launch_env()  # RANK, LOCAL_RANK, WORLD_SIZE from torchrun, or from srun's SLURM_* variables
    device = pick_device(args.device, env)  # cuda:LOCAL_RANK if there are GPUs, else the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this process uses this GPU, and only this one
    # env:// : every process meets the others at MASTER_ADDR:MASTER_PORT, where rank 0 listens.
    dist.init_process_group(backend=dist.get_default_backend_for_device(device),  # nccl on GPUs, gloo on CPUs
                            timeout=init_timeout(),
                            rank=env.rank, world_size=env.world_size, store=restart_safe_store(env),
                            device_id=device if device.type == "cuda" else None)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # write_line: one write per line, so the lines of ranks sharing a terminal or log file never interleave.
    write_line(f"host {socket.gethostname()} | rank {rank} of {world_size} | local rank {env.local_rank} | "
               f"device {device} | backend {dist.get_backend()}")
    result = {"rank": rank, "world_size": world_size, "host": socket.gethostname()}

    # all_reduce: every rank contributes rank+1; everyone ends with 1 + 2 + ... + W.
    t = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    result["all_reduce"] = t.item()

    # broadcast: rank 0's value overwrites everyone's (how DDP syncs the initial weights).
    t = torch.tensor([42.0 if rank == 0 else -1.0], device=device)
    dist.broadcast(t, src=0)
    result["broadcast"] = t.item()

    # all_gather: everyone receives every rank's tensor, in rank order.
    gathered = [torch.zeros(1, device=device) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([float(rank)], device=device))
    result["all_gather"] = [g.item() for g in gathered]

    # barrier: nobody passes until everyone has arrived.
    dist.barrier()

    expected = {"all_reduce": world_size * (world_size + 1) / 2, "broadcast": 42.0,
                "all_gather": [float(r) for r in range(world_size)]}
    failures = [name for name, value in expected.items() if result[name] != value]
    # Every rank's verdict is summed, so rank 0 knows whether anyone failed.
    bad = torch.tensor([float(len(failures))], device=device)
    dist.all_reduce(bad, op=dist.ReduceOp.SUM)
    result["ok"] = bad.item() == 0
    if failures:
        write_line(f"rank {rank}: FAILED {', '.join(failures)}")
    if rank == 0 and result["ok"]:
        write_line(f"OK: all_reduce, broadcast, all_gather and barrier verified on {world_size} rank(s)")
    dist.barrier()  # every verdict is printed before a failed rank exits: torchrun then stops the others at once
    dist.destroy_process_group()  # leave cleanly: no warning, no hanging sockets
    if not result["ok"]:
        sys.exit(1)
    return result


if __name__ == "__main__":
    run(main)

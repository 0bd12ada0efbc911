"""Lesson 01: the four collectives every distributed training job uses, each CHECKED.

    python hello_distributed.py                                   # one process
    torchrun --standalone --nproc_per_node=4 hello_distributed.py # four on this machine
    srun --ntasks-per-node=4 python hello_distributed.py          # Slurm, one task per GPU
Exits 0 and prints "OK" on rank 0 only if every result is what the maths says it must be.
"""
import socket
import sys

import torch
import torch.distributed as dist

from common.cli import run
from common.distributed import cleanup, setup


def check(name: str, ok: bool, failures: list) -> None:
    if not ok:
        failures.append(name)


def main(argv=None):
    ctx = setup(use_distributed="on")  # a group even of one process, so every call below works
    rank, world_size, device = ctx.rank, ctx.world_size, ctx.device
    print(f"host {socket.gethostname()} | rank {rank} of {world_size} | local rank {ctx.local_rank} | "
          f"device {device} | backend {ctx.backend}", flush=True)
    failures: list = []

    # all_reduce: every rank contributes rank+1; everyone ends with 1 + 2 + ... + W.
    t = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    check("all_reduce", t.item() == world_size * (world_size + 1) / 2, failures)

    # broadcast: rank 0's value overwrites everyone's (how DDP syncs the initial weights).
    t = torch.tensor([42.0 if rank == 0 else -1.0], device=device)
    dist.broadcast(t, src=0)
    check("broadcast", t.item() == 42.0, failures)

    # all_gather: everyone receives every rank's tensor, in rank order.
    gathered = [torch.zeros(1, device=device) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([float(rank)], device=device))
    check("all_gather", [g.item() for g in gathered] == list(range(world_size)), failures)

    # barrier: nobody passes until everyone has arrived.
    ctx.barrier()

    # Each rank's verdict, then rank 0 learns whether anyone failed.
    bad = torch.tensor([float(len(failures))], device=device)
    dist.all_reduce(bad, op=dist.ReduceOp.SUM)
    if failures:
        print(f"rank {rank}: FAILED {', '.join(failures)}", flush=True)
    if ctx.master_process and bad.item() == 0:
        print(f"OK: all_reduce, broadcast, all_gather and barrier verified on {world_size} rank(s)", flush=True)
    cleanup()
    if bad.item():
        sys.exit(1)


if __name__ == "__main__":
    run(main)

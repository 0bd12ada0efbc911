"""The worker functions of setup.ipynb: read this file beside the notebook.

Every function here runs in EVERY process of the job, once per rank. It starts the way a
training script starts, by joining the process group: ``dist.init_process_group("gloo")`` reads
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment (torchrun sets them; so does
the notebook's launcher, common/launcher.py, which also calls ``dist.destroy_process_group()``
when the function returns). Each rank prints what it sees, prefixed with its rank.

The same file runs under torchrun, with CPU tensors and gloo whatever GPUs the machine has:
    torchrun --standalone --nproc_per_node=2 01_setup/collective_workers.py
"""
import os
import sys

import torch
import torch.distributed as dist


def say(text):
    """Print one line prefixed with this process's rank, in ONE write (so lines of ranks
    sharing a terminal never interleave)."""
    sys.stdout.write(f"[rank {dist.get_rank()}] {text}\n")
    sys.stdout.flush()


def join():
    """Join the process group (once per process; this file's __main__ runs several functions)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # blocks until all WORLD_SIZE processes have joined


def who_am_i():
    """Say who we are, as the process group sees it."""
    join()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gpus = torch.cuda.device_count()  # 0 under the notebook's launcher: it hides the GPUs
    say(f"I am rank {rank} of {world_size} | LOCAL_RANK={os.environ['LOCAL_RANK']} "
        f"| rendezvous at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
        f"| backend {dist.get_backend()} | GPUs visible: {gpus}")
    return {"rank": rank, "world_size": world_size, "backend": dist.get_backend(), "gpus": gpus}


def all_reduce():
    """Every rank contributes rank + 1; afterwards every rank holds the SUM 1 + 2 + ... + W."""
    join()
    rank = dist.get_rank()
    t = torch.tensor([rank + 1.0])
    say(f"before all_reduce: {t}")
    dist.all_reduce(t, op=dist.ReduceOp.SUM)  # in place: t is overwritten with the sum
    say(f"after  all_reduce: {t}")
    return t.item()


def broadcast():
    """Rank 0's tensor overwrites everyone's: how DDP gives every replica the same initial weights."""
    join()
    rank = dist.get_rank()
    t = torch.tensor([42.0]) if rank == 0 else torch.tensor([-1.0])
    say(f"before broadcast: {t}")
    dist.broadcast(t, src=0)
    say(f"after  broadcast: {t}")
    return t.item()


def all_gather():
    """Everyone receives every rank's tensor, in rank order."""
    join()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor([10.0 * rank, 10.0 * rank + 1])
    gathered = [torch.zeros(2) for _ in range(world_size)]  # one slot per rank, filled in place
    say(f"before all_gather: mine={mine}")
    dist.all_gather(gathered, mine)
    say(f"after  all_gather: {gathered}")
    return [g.tolist() for g in gathered]


def fail_on_rank(bad_rank):
    """One rank raises; the others wait at a barrier for a partner that never comes."""
    join()
    rank = dist.get_rank()
    if rank == bad_rank:
        raise ValueError(f"rank {rank} cannot read its data shard")
    dist.barrier()  # the healthy ranks would wait here until the timeout


if __name__ == "__main__":  # under torchrun: every process runs this
    all_reduce()
    broadcast()
    all_gather()
    dist.destroy_process_group()

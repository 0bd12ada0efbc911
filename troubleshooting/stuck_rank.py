"""Failure 1, a stuck rank: one rank skips or reorders a collective, so the others wait for it.

    torchrun --standalone --nproc_per_node=2 troubleshooting/stuck_rank.py                # rank 1 skips an all_reduce
    torchrun --standalone --nproc_per_node=2 troubleshooting/stuck_rank.py --bug reorder  # two collectives, two orders
    torchrun --standalone --nproc_per_node=2 troubleshooting/stuck_rank.py --fix          # every rank, same order

A collective is a meeting: it completes only when every rank of the group has called it, with
the same operation, in the same order. Nothing checks this by default, so a rank that is missing
leaves the others waiting until the process-group timeout (30 min on gloo, 10 min on NCCL).
This script sets a 10 s timeout (--timeout) so the lab ends by itself.
"""
import argparse
import datetime
import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install

import torch
import torch.distributed as dist

from common.log import write_line as say  # one write per line: ranks' lines never interleave


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bug", choices=["skip", "reorder"], default="skip")
    parser.add_argument("--fix", action="store_true", help="every rank calls the same collectives in the same order")
    parser.add_argument("--timeout", type=float, default=10, help="seconds a collective may wait (default 10)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="nccl: one GPU per process")
    args = parser.parse_args()

    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    # The pid is what `py-spy dump --pid` needs while the job hangs.
    say(f"[rank {rank}] pid {os.getpid()}")

    for step in range(3):
        grad = torch.ones(1000, device=device)
        dist.all_reduce(grad)  # every rank, every step: what DDP does in backward()
    say(f"[rank {rank}] 3 steps done")

    loss = torch.tensor([1.0 + rank], device=device)
    stop = torch.tensor([0.0], device=device)
    if args.bug == "skip":
        # End of the epoch: average the loss for the log line. The bug: the collective sits
        # inside rank-0-only code, so rank 1 goes on to the barrier and rank 0 waits in all_reduce.
        if args.fix or rank == 0:
            dist.all_reduce(loss)
        if rank == 0:
            say(f"[rank 0] mean loss {loss.item() / dist.get_world_size():.2f}")
    else:
        # Two collectives whose order depends on the rank (in real code: iterating over a set or
        # a dict built differently per rank, or an early `continue` on one rank).
        ops = [lambda: dist.all_reduce(loss), lambda: dist.broadcast(stop, src=0)]
        if rank == 1 and not args.fix:
            ops.reverse()
        for op in ops:
            op()
        say(f"[rank {rank}] loss {loss.item():.1f} stop {stop.item():.0f}")

    dist.barrier()  # everyone waits here before rank 0 would save a checkpoint
    say(f"[rank {rank}] finished")
    dist.destroy_process_group()
    gc.collect()  # free the gloo group now, not during interpreter exit (see README: teardown)


if __name__ == "__main__":
    main()

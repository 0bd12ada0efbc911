"""Failure 5, rendezvous: the processes never find each other. The smallest distributed program.

    torchrun --standalone --nproc_per_node=2 troubleshooting/rendezvous.py    # works: "all_reduce of ones = 2"

The failures come from how it is launched (MASTER_ADDR, MASTER_PORT, the network interface),
not from this code: see troubleshooting/README.md for the commands. The process-group timeout
is 10 s (--timeout) so that a broken launch ends quickly instead of after 30 minutes.
"""
import argparse
import datetime
import gc
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install

import torch
import torch.distributed as dist

from common.log import write_line as say  # one write per line: ranks' lines never interleave


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=10, help="seconds to wait for the others (default 10)")
    args = parser.parse_args()

    # env:// rendezvous: torchrun (or you) set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    ones = torch.ones(1)
    dist.all_reduce(ones)
    say(f"[rank {rank}] host {socket.gethostname()} MASTER_ADDR={os.environ.get('MASTER_ADDR')} "
        f"MASTER_PORT={os.environ.get('MASTER_PORT')}: all_reduce of ones = {ones.item():.0f}")
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()  # free the gloo group now, not during interpreter exit (see README: teardown)


if __name__ == "__main__":
    main()

"""Lesson 01, exercise 1 (a solution): the mean over all ranks when the ranks hold different numbers of values.

From the course folder:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=3 01_setup/solutions/exact_mean.py

Rank r holds r + 1 values, each equal to r + 1 (rank 0: [1], rank 1: [2, 2], rank 2: [3, 3, 3]), as the last
shard of a data set is often smaller than the others. The exact mean takes ONE all_reduce(SUM) of (sum, count)
and one division at the end. The average of the per-rank means (what an averaging all_reduce returns) weighs every rank
the same, whatever it holds.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the course folder: `common`

import torch
import torch.distributed as dist

from common.distributed import launch_env
from common.exits import run
from common.log import plural, write_line


def main(argv=None):
    env = launch_env()  # torchrun's RANK and WORLD_SIZE; a plain `python` run is a group of one
    dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size)
    rank = dist.get_rank()
    values = torch.full((rank + 1,), float(rank + 1), dtype=torch.float64)
    write_line(f"[rank {rank}] {plural(len(values), 'value')}, local mean {values.mean().item():.4f}")

    totals = torch.tensor([values.sum().item(), len(values)], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # (sum of every value, number of values), on every rank
    exact = (totals[0] / totals[1]).item()

    mean_of_means = values.mean()
    dist.all_reduce(mean_of_means, op=dist.ReduceOp.SUM)
    mean_of_means /= dist.get_world_size()  # the average of averages: every rank counts the same
    if rank == 0:
        write_line(f"exact mean (SUM of sums / SUM of counts): {exact:.4f} over {plural(int(totals[1]), 'value')}")
        write_line(f"mean of the per-rank means (their SUM / {plural(dist.get_world_size(), 'rank')}): "
                   f"{mean_of_means.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)

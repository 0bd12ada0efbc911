"""Failure 4, replicas that diverge silently: every rank trains, no error, but on different weights.

    torchrun --standalone --nproc_per_node=2 troubleshooting/diverged_replicas.py                  # checksums differ
    torchrun --standalone --nproc_per_node=2 troubleshooting/diverged_replicas.py --fix same-seed  # seed, then create
    torchrun --standalone --nproc_per_node=2 troubleshooting/diverged_replicas.py --fix broadcast  # copy rank 0's weights
    torchrun --standalone --nproc_per_node=2 troubleshooting/diverged_replicas.py --fix ddp         # DDP broadcasts for you

The bug: the seed depends on the rank (to get different dropout or augmentation per rank) and is
set BEFORE the model is created, so each rank initialises different weights. A hand-written
data-parallel loop (or FSDP, or DDP(init_sync=False)) never copies rank 0's weights to the
others; averaging the gradients keeps the difference for ever. The detector: a checksum of the
parameters, reduced with MAX and MIN over the ranks; equal replicas give MAX == MIN.
"""
import argparse
import datetime
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.log import write_line as say  # one write per line: ranks' lines never interleave


def checksum(model: nn.Module) -> float:
    """The same number on every rank exactly when the replicas are identical (almost surely)."""
    flat = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)  # order matters, not just the sum
    return float((flat * weights).sum())


def replicas_agree(model: nn.Module) -> tuple[bool, float, float]:
    """all_reduce the checksum with MAX and with MIN: two tiny collectives, any number of ranks."""
    high = torch.tensor([checksum(model)], dtype=torch.float64)
    low = high.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return bool(high == low), high.item(), low.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fix", choices=["same-seed", "broadcast", "ddp"])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()

    if args.fix == "same-seed":
        torch.manual_seed(0)  # the same seed on every rank for the weights...
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        torch.manual_seed(100 + rank)  # ...and a rank-dependent one only afterwards, for the data
    else:
        torch.manual_seed(100 + rank)  # the bug: rank-dependent seed before the model exists
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    if args.fix == "broadcast":
        for p in model.parameters():  # what DDP does at construction (buffers too, if any)
            dist.broadcast(p.data, src=0)
    if args.fix == "ddp":
        model = DDP(model)  # broadcasts rank 0's parameters and buffers when it is built

    same, high, low = replicas_agree(model)
    say(f"[rank {rank}] after init: checksum {checksum(model):.6f}, replicas equal: {same}")

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(args.steps):
        x, y = torch.randn(32, 16), torch.randn(32, 1)  # different data per rank, as intended
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if args.fix != "ddp":
            for p in model.parameters():  # the hand-written data parallelism: average the gradients
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()

    same, high, low = replicas_agree(model)
    say(f"[rank {rank}] after {args.steps} steps: checksum {checksum(model):.6f}")
    if rank == 0:
        verdict = "replicas identical" if same else f"REPLICAS DIVERGED (max {high:.6f} != min {low:.6f})"
        say(f"[rank 0] parameter checksum over {world} ranks: {verdict}")
    dist.destroy_process_group()
    gc.collect()  # free the gloo group now, not during interpreter exit (see README: teardown)


if __name__ == "__main__":
    main()

"""Failure 2, uneven inputs: ranks with different numbers of batches hang at the end of the epoch.

    torchrun --standalone --nproc_per_node=2 troubleshooting/uneven_inputs.py               # 6 + 4 examples: hangs
    torchrun --standalone --nproc_per_node=2 troubleshooting/uneven_inputs.py --fix join    # DDP's Join context
    torchrun --standalone --nproc_per_node=2 troubleshooting/uneven_inputs.py --fix shards  # DistributedSampler

DDP all_reduces the gradients in every backward(). A rank that runs out of batches first stops
calling that all_reduce; the rank with one batch more waits in it, while the first one waits at
the next collective (here the barrier before saving). The split by hand below gives rank 0
three batches and rank 1 two. --timeout (10 s) ends the hang.
"""
import argparse
import contextlib
import datetime
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from common.log import write_line as say  # one write per line: ranks' lines never interleave


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fix", choices=["join", "shards"])
    parser.add_argument("--timeout", type=float, default=10, help="seconds a collective may wait (default 10)")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(10, 8), torch.randn(10, 1))

    if args.fix == "shards":
        # Equal shards: DistributedSampler pads (or, with drop_last=True, trims) to the same
        # number of examples on every rank, so every rank runs the same number of steps.
        loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, shuffle=False))
    else:
        # The bug: a split by hand, "first 60% to rank 0" (np.array_split-like splits of an
        # uneven length do the same). Rank 0 gets 6 examples = 3 batches, rank 1 4 = 2 batches.
        first = round(len(data) * 0.6)
        indices = range(0, first) if rank == 0 else range(first, len(data))
        loader = DataLoader(Subset(data, list(indices)), batch_size=2)

    model = DDP(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Join: a rank that has finished its batches "shadows" the all_reduces of the ranks still
    # training (it contributes zeros), until every rank has left the context.
    join = Join([model]) if args.fix == "join" else contextlib.nullcontext()
    steps = 0
    with join:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()  # DDP's gradient all_reduce happens here
            opt.step()
            steps += 1
    say(f"[rank {rank}] {steps} steps done")

    dist.barrier()  # all ranks meet before rank 0 would save a checkpoint
    counts = torch.tensor([float(steps)])
    dist.all_reduce(counts)
    say(f"[rank {rank}] finished: {steps} steps here, {counts.item():.0f} over {world} ranks")
    dist.destroy_process_group()
    gc.collect()  # free the gloo group now, not during interpreter exit (see README: teardown)


if __name__ == "__main__":
    main()

"""Failure 3, unused parameters: a layer that takes no part in the forward pass breaks DDP.

    torchrun --standalone --nproc_per_node=2 troubleshooting/unused_parameters.py                     # error at step 2
    torchrun --standalone --nproc_per_node=2 troubleshooting/unused_parameters.py --fix remove        # delete the layer
    torchrun --standalone --nproc_per_node=2 troubleshooting/unused_parameters.py --fix find-unused   # DDP searches each step
    torchrun --standalone --nproc_per_node=2 troubleshooting/unused_parameters.py --fix static-graph  # DDP learns it once

DDP puts the gradients in buckets and all_reduces a bucket once every parameter in it has its
gradient. The `unused` layer never gets one, so its bucket is never reduced; at the next forward
DDP notices that the previous reduction never finished and raises. Rank 0 prints ms/step so the
fixes can be compared (--steps, --depth make the model longer).
"""
import argparse
import datetime
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP



class Net(nn.Module):
    def __init__(self, depth: int, with_unused: bool):
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(depth)])
        self.head = nn.Linear(32, 1)
        if with_unused:
            self.unused = nn.Linear(32, 32)  # e.g. a leftover head, or a branch taken only sometimes

    def forward(self, x):
        return self.head(self.body(x))  # self.unused is never called

from common.log import write_line as say  # one write per line: ranks' lines never interleave


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fix", choices=["remove", "find-unused", "static-graph"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--depth", type=int, default=4, help="hidden layers; more layers = a longer graph to search")
    parser.add_argument("--timeout", type=float, default=10, help="seconds a collective may wait (default 10)")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net(args.depth, with_unused=args.fix != "remove")
    ddp_options = {
        # Walks the autograd graph after every forward to find the parameters that will get no
        # gradient and marks them ready: correct for any model, at a cost every step.
        "find-unused": {"find_unused_parameters": True},
        # Records which parameters were used in the first iteration and assumes the same set
        # (and the same graph) every iteration: cheaper, but only for a graph that never changes.
        "static-graph": {"static_graph": True},
    }.get(args.fix, {})
    model = DDP(model, **ddp_options)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    x, y = torch.randn(64, 32), torch.randn(64, 1)
    start = None
    for step in range(1, args.steps + 1):
        if step == 2:
            start = time.perf_counter()  # step 1 is a warm-up (static_graph learns the graph there)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            say(f"[rank 0] step {step} loss {loss.item():.4f}")
    if rank == 0 and args.steps > 1:
        ms = (time.perf_counter() - start) * 1000 / (args.steps - 1)
        say(f"[rank 0] fix={args.fix} depth={args.depth}: {ms:.2f} ms/step")
    dist.destroy_process_group()
    gc.collect()  # free the gloo group now, not during interpreter exit (see README: teardown)


if __name__ == "__main__":
    main()

"""Exercise 2 of lesson 05: count what each rank really holds, with to_local(), after one AdamW step.

    torchrun --standalone --nproc_per_node=3 05_multigpu_fsdp_training/solutions/shard_bytes.py

Every rank builds lesson 05's model the lesson's way (Net() with the seed, one fully_shard per unit, then the root),
takes one AdamW step on random images, and adds up the bytes of the tensors it stores. Rank 0 then
checks the answers: the shards add up to the whole model (nothing duplicated, about 1/N each), and AdamW's state is
2 x the parameter bytes PLUS 4 B per parameter tensor on every rank: the `step` counters, which are not sharded.
Writes nothing.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the course folder: `common`

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from common.errors import CourseError
from common.exits import run
from common.log import write_line
from common.model import Net, count_parameters


def nbytes(t) -> int:
    """What this rank stores of `t`: its local shard for a DTensor, all of it for a plain tensor."""
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def my_rows(rows: int, rank: int, world: int) -> int:
    """Shard(0) cuts like torch.chunk: ceil(rows / world) rows per rank, the last ranks get what is left (maybe 0)."""
    per = -(-rows // world)
    return max(0, min(per, rows - rank * per))


def main(argv=None):
    args = argparse.Namespace(seed=1, width=1, blocks=2, hidden=256)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(args.seed)  # the same weights on every rank, before each keeps its shard
    model = Net(width=args.width, blocks=args.blocks, hidden=args.hidden)
    for unit in [model.features, model.fc1, *model.blocks, model.fc2, model]:  # the lesson's units, then the root
        fully_shard(unit, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    F.nll_loss(model(torch.randn(8, 1, 28, 28)), torch.randint(0, 10, (8,))).backward()
    optimizer.step()

    params = list(model.parameters())
    states = [optimizer.state[p] for p in params]
    held = {"params": sum(nbytes(p) for p in params),
            "grads": sum(nbytes(p.grad) for p in params),
            "moments": sum(nbytes(s["exp_avg"]) + nbytes(s["exp_avg_sq"]) for s in states),  # DTensors, sharded
            "steps": sum(nbytes(s["step"]) for s in states)}  # one 0-dim tensor per parameter, a plain tensor
    held["expected"] = sum(my_rows(p.shape[0], rank, world) * p.shape[1:].numel() * 4 for p in params)  # fp32 rows
    step = states[0]["step"]
    write_line(f"[rank {rank}] fc1.weight rows {model.fc1.weight.to_local().shape[0]} of {model.fc1.weight.shape[0]}, "
               f"fc2.weight rows {model.fc2.weight.to_local().shape[0]} of 10 | params {held['params']:,} B | "
               f"grads {held['grads']:,} B | exp_avg + exp_avg_sq {held['moments']:,} B | step counters "
               f"{held['steps']} B ({type(step).__name__}, shape {tuple(step.shape)}, {step.dtype}, {step.device})")  # one write: ranks never interleave

    everyone = [None] * world
    dist.all_gather_object(everyone, held)
    failed = []  # checked on rank 0
    if rank == 0:
        whole, tensors = 4 * count_parameters(model), len(params)  # fp32: 4 B per parameter of the full model
        together = sum(h["params"] for h in everyone)
        checks = {f"the {world} shards add up to the whole model, {whole:,} B (4 B x {whole // 4:,} parameters)":
                  together == whole and sum(h["grads"] for h in everyone) == whole,
                  f"the largest rank holds {max(h['params'] for h in everyone) / whole:.3f} of it (1/{world} = "
                  f"{1 / world:.3f}), every rank its torch.chunk rows exactly": all(h["params"] == h["expected"]
                                                                                   for h in everyone),
                  f"AdamW state = 2 x params + 4 B x {tensors} tensors on every rank: each `step` counter is a "
                  f"whole 4-byte tensor per rank, not sharded":
                  all(h["moments"] == 2 * h["params"] and h["steps"] == 4 * tensors for h in everyone)}
        for text in (text for text, ok in checks.items() if ok):
            print(f"OK: {text}", flush=True)
        failed = [text for text, ok in checks.items() if not ok]
    dist.destroy_process_group()
    if failed:  # rank 0 only: `error: ...` and exit 2
        raise CourseError(f"not as expected: {'; '.join(failed)}")


if __name__ == "__main__":
    run(main)

"""Exercise 3 of lesson 05: what `fully_shard(unit, reshard_after_forward=False)` keeps, and what it saves.

    torchrun --standalone --nproc_per_node=2 05_multigpu_fsdp_training/solutions/reshard_probe.py

Lesson 05's model is sharded twice, the lesson's way, once with the default reshard_after_forward=True and once with
False. After one forward, the probe adds up the bytes of FULL (gathered, plain-tensor) parameters the rank still holds,
then counts the all-gathers and reduce-scatters of backward with CommDebugMode. On CPU no memory peak can be read, so
the tensors are counted instead. Writes nothing.
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
from torch.distributed.tensor.debug import CommDebugMode

from common.errors import CourseError
from common.exits import run
from common.model import Net

ALL_GATHER, REDUCE_SCATTER = torch.ops.c10d._allgather_base_, torch.ops.c10d._reduce_scatter_base_  # FSDP2's calls


def probe(args, mesh, reshard_after_forward: bool) -> dict:
    torch.manual_seed(args.seed)  # as in the lesson: the same weights on every rank, before each keeps its shard
    model = Net(width=args.width, blocks=args.blocks, hidden=args.hidden)
    units = [model.features, model.fc1, *model.blocks, model.fc2]
    for unit in [*units, model]:  # the lesson's units, then the root
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    loss = F.nll_loss(model(torch.randn(8, 1, 28, 28)), torch.randint(0, 10, (8,)))
    # Between forward and backward: a resharded unit's parameters are DTensor shards again; a kept one's are plain
    # full tensors (FSDP2 swaps the module's parameters when it gathers and when it frees).
    full = [p for p in model.parameters() if not isinstance(p, DTensor)]
    with CommDebugMode() as comm:  # counts the collectives dispatched inside backward (not around forward: there
        loss.backward()            # it makes FSDP2 warn about view outputs)
    counts = comm.get_comm_counts()
    return {"units": len(units), "full_bytes": sum(p.numel() * p.element_size() for p in full),
            "all_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "all_gathers": counts[ALL_GATHER], "reduce_scatters": counts[REDUCE_SCATTER]}


def main(argv=None):
    args = argparse.Namespace(seed=1, width=1, blocks=2, hidden=256)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {flag: probe(args, mesh, flag) for flag in (True, False)}
    failed = []  # checked on rank 0
    if dist.get_rank() == 0:
        for flag, r in results.items():
            print(f"reshard_after_forward={flag}: after forward {r['full_bytes']:,} B of full weights held "
                  f"(model {r['all_bytes']:,} B); backward: {r['all_gathers']} all-gathers, "
                  f"{r['reduce_scatters']} reduce-scatters ({r['units']} units)", flush=True)
        on, off = results[True], results[False]
        checks = {"True frees every unit after its forward, and backward gathers each one again":
                  on["full_bytes"] == 0 and on["all_gathers"] == on["units"],
                  "False keeps every unit's full weights until its backward: no all-gather in backward":
                  off["full_bytes"] == off["all_bytes"] and off["all_gathers"] == 0,
                  "both reduce-scatter every unit's gradients once": on["reduce_scatters"] == off["reduce_scatters"]
                  == on["units"]}
        for text in (text for text, ok in checks.items() if ok):
            print(f"OK: {text}", flush=True)
        failed = [text for text, ok in checks.items() if not ok]
    dist.destroy_process_group()
    if failed:  # rank 0 only: `error: ...` and exit 2
        raise CourseError(f"not as expected: {'; '.join(failed)}")


if __name__ == "__main__":
    run(main)

r"""Lesson 07's smallest pipeline, on public APIs only: a small model cut in two by hand, one PipelineStage per rank,
ScheduleGPipe (or Schedule1F1B) and one training step. Each rank prints what it ran, in its order: each micro-batch's
forward (F) and backward (B), what it got and what it sent on; then its gradients against one process's on the
whole batch. From the course folder:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 07_pipeline_parallel/pp_minimal.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 07_pipeline_parallel/pp_minimal.py --schedule 1f1b
The notebook (pipeline.ipynb) and exercise 2 run step() in 2 gloo processes of common.launcher instead.
mnist_ppmodel.py tells the same story at full size: lesson 06's TPNet cut into stages, FSDP2, checkpoints.
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` (its one-line errors)
sys.path.insert(1, str(Path(__file__).resolve().parent))  # this folder: torch_floor

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from common.errors import CourseError
from common.exits import run
from torch_floor import require_torch_2_10

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def tiny_model() -> nn.Sequential:
    """6 features -> 8 -> 8 -> 3 classes, the same weights on every rank (seed 0)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def tiny_batch(size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)


def watch(part: nn.Module, rank: int, events: list[str]) -> None:
    """A forward hook on this rank's layers, and gradient hooks on the tensors it gets and sends: each forward and
    backward, in the order they run. A schedule runs the forwards in micro-batch order: the k-th is micro-batch k."""
    def on_forward(module, inputs, output):
        mb = sum(e.startswith("F") for e in events)
        if rank == 0:
            events.append(f"F{mb}: images {tuple(inputs[0].shape)} of micro-batch {mb} -> sends "
                          f"{tuple(output.shape)} to rank 1")
            output.register_hook(lambda g: events.append(f"B{mb}: receives the gradient {tuple(g.shape)} from "
                                                         f"rank 1 -> the gradients of layer 0"))
        else:
            events.append(f"F{mb}: receives {tuple(inputs[0].shape)} from rank 0 -> output {tuple(output.shape)} "
                          f"-> loss")
            inputs[0].register_hook(lambda g: events.append(f"B{mb}: sends the gradient {tuple(g.shape)} of what "
                                                            f"it received back to rank 0"))
    part.register_forward_hook(on_forward)


def step(schedule: str = "gpipe", microbatches: int = 4, scale_grads: bool = True, quiet: bool = False) -> dict:
    """One training step of tiny_model cut in two (layers 0-1 on rank 0, 2-4 on rank 1); returns the numbers."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    part = tiny_model()[:2] if rank == 0 else tiny_model()[2:]  # slices keep the layers' names: "0", "2", "4"
    images, labels = tiny_batch()
    mb = len(images) // microbatches
    stage = PipelineStage(part, rank, p, torch.device("cpu"))  # stage `rank` of p; sends and receives: the world
    pipe = SCHEDULES[schedule](stage, microbatches, loss_fn=F.cross_entropy, scale_grads=scale_grads)
    events, losses = [], []
    for watched in (False, True):  # the first step() also runs micro-batch 0 ahead, to learn the shapes: not shown
        part.zero_grad()
        losses.clear()
        if watched:
            watch(part, rank, events)
        if rank == 0:
            pipe.step(images)  # the whole batch: the schedule cuts it into micro-batches
        else:
            pipe.step(target=labels, losses=losses, return_outputs=False)  # the labels; one loss per micro-batch

    reference = tiny_model()  # one process, the whole batch, the mean loss
    whole = F.cross_entropy(reference(images), labels)
    whole.backward()
    ref = dict(reference.named_parameters())
    factor = 1 if scale_grads else microbatches  # scale_grads=False: the sum of the micro-batches' mean losses
    diff = max((q.grad - factor * ref[k].grad).abs().max().item() for k, q in part.named_parameters())
    order = " ".join(e.split(":")[0] for e in events)
    lines = [f"stage {rank} of {p} ({', '.join(f'{k}: {type(m).__name__}' for k, m in part.named_children())}): "
             f"{sum(q.numel() for q in part.parameters())} parameters",
             f"{schedule}, {microbatches} micro-batches of {mb}; order: {order}", *[f"  {e}" for e in events]]
    if losses:
        lines += [f"losses of the {len(losses)} micro-batches: {[round(x.item(), 4) for x in losses]}",
                  f"their mean {torch.stack(losses).mean().item():.6f}; one process, the whole batch: "
                  f"{whole.item():.6f}"]
    lines.append(f"max |grad - one process's grad| over {', '.join(k for k, _ in part.named_parameters())}: {diff:.1e}")
    for r in range(p):  # rank 0's lines first, then rank 1's
        if r == rank and not quiet:
            print("\n".join(lines), flush=True)
        dist.barrier()
    return {"order": order, "diff": diff, "grads": {k: q.grad for k, q in part.named_parameters()},
            "loss_diff": abs(torch.stack(losses).mean().item() - whole.item()) if losses else None}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="gpipe")
    parser.add_argument("--microbatches", type=int, choices=[2, 4, 8], default=4, help="(default: 4)")
    args = parser.parse_args(argv)
    require_torch_2_10()
    if os.environ.get("WORLD_SIZE") != "2":
        raise CourseError("pp_minimal.py cuts its model in two, a stage per process: start it with "
                          "torchrun --standalone --nproc_per_node=2")
    step(args.schedule, args.microbatches)
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)

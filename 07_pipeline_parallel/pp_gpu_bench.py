"""Pipeline parallelism on GPUs for the benchmark runner's `pp` suite (benchmarks/suites.py): PP on lesson 06's TPNet,
measured like 06_tensor_parallel/tp_gpu_bench.py measures DDP, FSDP2 and TP on it, so the four share one model, one
global batch and one row format; a failure (here, or in bubble.py's measure of each schedule) kept as a row.

    python benchmarks/bench.py --suite pp --gpus 2,4 --data-dir data    # rows and a section in docs/benchmarks.md

PP here: TPNet cut into as many stages as ranks by lesson 07's own Stage and stage_blocks (the even cut: stage 0 also
holds the convolutions and fc1), driven by the trainer's make_schedule (trainer/pp.py); every rank reads the same global batch (stage 0
its images, the last stage its labels), cut into micro-batches. Each stage's layers get their own initialisation
(reset_parameters after one seed), not the DDP run's weights: the values change no timing. Peak memory: the most any
rank allocated during the timed steps, less what it held before the model was built (as tp_gpu_bench.measure: the
training images, copied to the GPU after that, count). Wire bytes: the most one rank sends per step, activations
forward and their gradients back (a middle stage does both).
"""
import argparse
import gc
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE.parent / "06_tensor_parallel")]  # common, bubble, tp_gpu_bench

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

import tp_gpu_bench  # noqa: E402
import trainer.pp as pipeline  # noqa: E402
from common.loaders import DeviceLoader  # noqa: E402


def build_pp(args, device, world: int):
    """This rank's stage of TPNet (one per rank) under lesson 07's schedule, and all its layers as one module."""
    L = pipeline
    with torch.device("meta"):
        net = tp_gpu_bench.lesson().TPNet(blocks=args.blocks, hidden=args.hidden)
    rank, ranges = dist.get_rank(), L.stage_blocks(args.blocks, world)
    stage = L.Stage(net, ranges[rank], rank == 0, rank == world - 1)
    stage.to_empty(device=device)
    torch.manual_seed(args.seed + rank)
    with torch.no_grad():
        for module in stage.modules():
            if list(module.parameters(recurse=False)):
                module.reset_parameters()
    flags = argparse.Namespace(pp_schedule=args.schedule, microbatches=args.microbatches)
    return stage, L.make_schedule(flags, [stage], [rank], world, dist.group.WORLD, device, training=True)


def measure_pp(args, device, world: int, dataset) -> dict:
    """tp_gpu_bench.measure's row for PP: the same steps, timing and peak; images/s of the global batch."""
    gc.collect()  # the previous strategy's model and optimizer state, freed before this one is built
    if device.type == "cuda":
        torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    model, schedule = build_pp(args, device, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = iter(DeviceLoader(dataset, args.batch_size, DistributedSampler(dataset, 1, 0, seed=args.seed), device))
    first, last = model.first, model.last

    def step():
        images, labels = next(batches)
        schedule.step(*[images] * first, target=labels if last else None, return_outputs=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    tp_gpu_bench.sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    tp_gpu_bench.sync(device)
    mine = torch.tensor([(time.perf_counter() - start) / args.steps,
                         torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0],
                        dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's time, the fullest rank's memory
    seconds, peak = mine.tolist()
    del model, optimizer, schedule
    sent = (2 if world > 2 else 1) * args.batch_size * args.hidden * 4  # float32 activations (and gradients back)
    return {"strategy": "pp", "s_per_step": seconds, "images_per_s": args.batch_size / seconds,
            "peak_mib": peak / 2**20, "wire_mb_per_step": sent / 1e6, "schedule": args.schedule,
            "microbatches": args.microbatches}


def compare(strategy: str, args, device, world: int, dataset, busbw: float) -> dict:
    """One strategy on TPNet at the global batch args.batch_size: DDP and FSDP2 give each rank its share of it, TP and
    PP give every rank all of it."""
    if strategy == "pp":
        return measure_pp(args, device, world, dataset)
    share = args.batch_size // world if strategy in ("ddp", "fsdp2") else args.batch_size
    return tp_gpu_bench.measure(strategy, argparse.Namespace(**{**vars(args), "batch_size": share}), device, world,
                                dataset, busbw)


def attempt(run, **failed) -> dict:
    """run()'s row, or its failure as a row (e.g. a schedule this torch cannot run): the launch goes on. A failure
    before the first send (building a schedule, its shapes) fails every rank alike; one inside a step may leave the
    other ranks waiting until the process group's timeout, so the suite runs the riskiest schedule last."""
    try:
        return run()
    except Exception as e:  # recorded, not raised
        return {**failed, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}

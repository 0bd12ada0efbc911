"""DDP, FSDP2, TP (and on 4+ GPUs 2-D: TP in pairs, FSDP2 across them) on the same TPNet, one after the other in
one process group: seconds per step, peak memory, and the communication time predicted from the measured bus
bandwidth against the profiled NCCL kernel time. The benchmark runner's `tp` suite (benchmarks/worker.py) runs it:

    python benchmarks/bench.py --suite tp --gpus 2,4 --data-dir data    # rows and a section in docs/benchmarks.md

DDP and FSDP2 give each rank its own batch (a step trains N x --batch-size images), TP gives every rank the
same one (a step trains --batch-size images), so the table shows images/s too. The predicted communication
is docs/communication.md's wire bytes (06_tensor_parallel/comm_bytes.py) / bus bandwidth, the bandwidth
measured here as lesson 01 does (all_reduce of 64 MiB, busbw = 2(n-1)/n x size / time). The profiled time
sums the NCCL kernels' durations, which include the time a kernel waits for the other rank: an upper bound
on the transfer time (DDP's kernels overlap backward, so they cost less than their sum). Peak memory: the most
allocated during the timed steps, less what was allocated before the model was built (the data set). On CPU
(gloo) it runs too, for checking (bench.py --quick).
"""
import argparse
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install
os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's engine would print its start and stop lines

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

from comm_bytes import predict, wire  # noqa: E402
from common.loaders import DeviceLoader  # noqa: E402
from tp_workers import lesson  # noqa: E402
from trainer.fsdp2 import init_weights  # noqa: E402  (the trainer's: built on the meta device)
from trainer.tp import TPNet, parallelize  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bus_bandwidth(device, world: int, size: int = 64 * 2**20, repeats: int = 10) -> float:
    """Bytes/s each rank's link carries in a ring all_reduce of `size` bytes (lesson 01's busbw)."""
    t = torch.ones(size // 4, device=device)
    for _ in range(3):
        dist.all_reduce(t)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(t)
    sync(device)
    seconds = torch.tensor([(time.perf_counter() - start) / repeats], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return 2 * (world - 1) / world * size / seconds.item()


def strategies(world: int) -> tuple:
    return ("ddp", "fsdp2", "tp") + (("2d",) if world >= 4 and world % 2 == 0 else ())


def parameters(args) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in lesson().TPNet(blocks=args.blocks, hidden=args.hidden).parameters())


def build(strategy: str, args, device, world: int):
    L = lesson()
    if strategy == "ddp":
        torch.manual_seed(args.seed)
        model = L.TPNet(blocks=args.blocks, hidden=args.hidden).to(device)
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None), world, 0
    tp = {"tp": world, "2d": 2}.get(strategy, 1)  # 2-D: TP in pairs, FSDP2 across the pairs
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = L.TPNet(blocks=args.blocks, hidden=args.hidden)
    parallelize(model, mesh)
    model.to_empty(device=device)
    init_weights(model, argparse.Namespace(seed=args.seed, width=1, blocks=args.blocks, hidden=args.hidden), TPNet)
    return model, mesh.size(0), mesh.get_local_rank("dp")


def measure(strategy: str, args, device, world: int, dataset, busbw: float) -> dict:
    gc.collect()  # the previous strategy's model and optimizer state, freed before this one is built
    if device.type == "cuda":
        torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0  # the data set, left out of peak
    model, dp, dp_rank = build(strategy, args, device, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = DeviceLoader(dataset, args.batch_size, DistributedSampler(dataset, dp, dp_rank, seed=args.seed), device)
    batches = iter(loader)

    def step():
        images, labels = next(batches)
        F.nll_loss(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    seconds = (time.perf_counter() - start) / args.steps
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, acc_events=True) as prof:
        for _ in range(args.profiled_steps):
            step()
        sync(device)
    if device.type == "cuda":  # the NCCL kernels themselves (their CPU-side ops would count them a second time)
        comm_s = sum(e.time_range.elapsed_us() for e in prof.events()
                     if e.device_type == DeviceType.CUDA and "nccl" in e.name.lower()) / 1e6
    else:  # gloo runs on CPU threads: its ops' CPU time
        comm_s = sum(e.cpu_time_total for e in prof.key_averages() if "gloo" in e.key.lower()) / 1e6
    tp = world // dp
    payloads = predict("ddp" if strategy == "ddp" else "fsdp", args.blocks, args.hidden, args.batch_size, dp=dp, tp=tp)
    # TP's all_reduces run among the tp ranks of a group, FSDP2's gathers and reduce-scatters among the dp ones
    wire_bytes = sum(wire(c, b, tp if c == "all_reduce" and tp > 1 else dp) for c, b in payloads.items())
    del model, optimizer
    return {"strategy": strategy, "s_per_step": seconds, "images_per_s": dp * args.batch_size / seconds,
            "peak_mib": peak / 2**20, "wire_mb_per_step": wire_bytes / 1e6,
            "predicted_comm_ms": 1e3 * wire_bytes / busbw, "profiled_comm_ms": 1e3 * comm_s / args.profiled_steps}

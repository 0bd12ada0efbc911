"""Does DDP overlap its gradient all_reduce with backward? One profiled step per bucket setting, and the picture.

DDP groups gradients into buckets in the order backward produces them (last layer first) and all_reduces a
bucket as soon as it is complete, while backward goes on. The classic Net has 4.8 MB of gradients, 4.7 MB of
them fc1's weight. Variants (an explicit bucket_cap_mb=25 is NOT the default: it applies to the first bucket too):
    default   bucket_cap_mb unset: a 1 MB first bucket, then 25 MB ones    one     100 MB: one bucket, after backward
    small     0.001 MB: a bucket closes at every tensor past 1 KB           no_sync two micro-batches, the first local
On GPUs the lanes are compute kernels and NCCL kernels; on the CPU (gloo) the main thread's operators and gloo's.
"""
from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

from common.model import Net

VARIANTS = {"default": (None, [True]), "one": (100, [True]), "small": (0.001, [True]),
            "no_sync": (None, [False, False, True])}  # name -> (bucket_cap_mb, micro-batches: True = synced)


def profile_step(variant: str, device, batch: int, trace: str, warmup: int = 5) -> str:
    """Warm up (DDP rebuilds its buckets at the 2nd step), then trace ONE step; returns DDP's bucket sizes."""
    cap, micro_batches = VARIANTS[variant]
    torch.manual_seed(0)
    model = DDP(Net().to(device), device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=cap)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
    x, y = torch.randn(batch, 1, 28, 28, device=device), torch.randint(0, 10, (batch,), device=device)

    def step():
        for i, sync in enumerate(micro_batches):
            with nullcontext() if sync else model.no_sync():  # no_sync: gradients stay local, nothing is sent
                with record_function(f"forward {i}"):
                    loss = F.nll_loss(model(x), y)
                with record_function(f"backward {i}"):
                    loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(max(warmup, 2)):
        step()
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        dist.barrier()  # the ranks start the profiled step together
        if cuda:
            torch.cuda.synchronize(device)
        with record_function("step"):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    prof.export_chrome_trace(trace)
    return str(model._get_ddp_logging_data().get("rebuilt_bucket_sizes", "?"))  # DDP's debug log (private API)


def _union(spans):
    merged = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _length(spans) -> float:
    return sum(e - s for s, e in _union(spans))


def _both(a, b) -> float:
    b = _union(b)
    return sum(max(0.0, min(e, be) - max(s, bs)) for s, e in _union(a) for bs, be in b)


def lanes(trace: str) -> dict:
    """{lanes: {name: [(start_ms, end_ms)]}, backward: [...], step_ms}, in ms from the step's start."""
    events = [e for e in json.loads(Path(trace).read_text())["traceEvents"] if e.get("ph") == "X"]
    marks = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "user_annotation"}
    t0, t1 = marks["step"]
    span = lambda ts, dur: ((ts - t0) / 1e3, (ts + dur - t0) / 1e3)  # noqa: E731
    backward_cpu = [w for name, w in marks.items() if name.startswith("backward")]
    if any(e.get("cat") == "kernel" for e in events):
        kernels = [e for e in events if e.get("cat") == "kernel" and e["ts"] >= t0]
        comm = [span(e["ts"], e["dur"]) for e in kernels if "nccl" in e["name"].lower()]
        compute = [span(e["ts"], e["dur"]) for e in kernels if "nccl" not in e["name"].lower()]
        # Backward on the GPU: the compute kernels LAUNCHED during backward() (a launch and its kernel share a
        # correlation id); the GPU runs them later than the CPU queues them.
        corr = lambda e: e.get("args", {}).get("correlation")  # noqa: E731
        launches = [(e["ts"], corr(e)) for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
        backward = []
        for b0, b1 in backward_cpu:
            ids = {c for ts, c in launches if b0 <= ts <= b1}
            mine = [span(e["ts"], e["dur"]) for e in kernels if corr(e) in ids and "nccl" not in e["name"].lower()]
            backward.append((min(s for s, _ in mine), max(e for _, e in mine)) if mine else span(b0, b1 - b0))
        names = ("compute kernels", "NCCL kernels")
    else:
        main = next(e["tid"] for e in events if e["name"] == "step")
        ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e["tid"] == main and t0 <= e["ts"] <= t1),
                     key=lambda e: e["ts"])
        compute, end = [], -1.0
        for e in ops:  # top-level operators only: a nested one lies inside its parent
            if e["ts"] >= end and not e["name"].startswith("c10d::"):
                compute.append(span(e["ts"], e["dur"]))
                end = e["ts"] + e["dur"]
        comm = [span(e["ts"], e["dur"]) for e in events if e["name"].startswith(("gloo:", "nccl:"))
                and e["ts"] + e["dur"] >= t0 and e["ts"] <= t1]
        backward = [span(b0, b1 - b0) for b0, b1 in backward_cpu]
        names = ("CPU operators (main thread)", "collectives (backend threads)")
    step_ms = max([e for _, e in compute + comm] + [(t1 - t0) / 1e3])
    return {"lanes": dict(zip(names, (compute, comm))), "backward": backward, "step_ms": step_ms}


def numbers(info: dict) -> dict:
    compute, comm = info["lanes"].values()
    comm_ms, hidden = _length(comm), _both(comm, compute)
    return {"step_ms": info["step_ms"], "backward_ms": _length(info["backward"]), "comm_kernels": len(comm),
            "comm_ms": comm_ms, "overlapped_ms": hidden, "exposed_ms": comm_ms - hidden}


def draw(results: dict, path, title: str) -> None:
    """One row per variant: compute and communication lanes, backward shaded grey."""
    import matplotlib
    matplotlib.use("Agg")  # files only: GPU nodes have no display
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.2 * len(results)), layout="constrained", squeeze=False)
    for ax, (variant, (info, n)) in zip(axes[:, 0], results.items()):
        for s, e in info["backward"]:
            ax.axvspan(s, e, color="0.88", zorder=0)
        for row, (spans, color) in enumerate(zip(info["lanes"].values(), ("tab:blue", "tab:orange"))):
            ax.broken_barh([(s, max(e - s, info["step_ms"] / 2000)) for s, e in spans], (row - 0.4, 0.8), color=color)
        ax.set_yticks([0, 1], list(info["lanes"]))
        ax.set(ylim=(-0.7, 1.7), xlim=(0, info["step_ms"] * 1.02))
        ax.set_title(f"{variant}: {n['comm_kernels']} all_reduce(s), {n['comm_ms']:.3f} ms of communication, "
                     f"{n['overlapped_ms']:.3f} ms of it under compute (grey: backward)", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel(f"ms from the start of the step (rank 0); {title}")
    fig.savefig(path, dpi=110)
    plt.close(fig)

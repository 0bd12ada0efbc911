"""See DDP overlap its gradient all_reduce with backward: one profiled training step per variant, drawn.

    torchrun --standalone --nproc_per_node=2 benchmarks/ddp_overlap.py --out OUT            # 2 GPUs, NCCL
    torchrun --standalone --nproc_per_node=2 benchmarks/ddp_overlap.py --device cpu --batch-size 32 --out OUT

DDP groups the gradients into buckets, in the order backward produces them (last layer first), and
all_reduces a bucket as soon as its last gradient is ready, while backward goes on computing the
earlier layers. The classic Net has 4.8 MB of gradients, 4.7 MB of them fc1's weight. Variants:
    default   bucket_cap_mb unset: 25 MB buckets, except a 1 MB first one   -> 2 buckets: fc2+fc1, then the convs
    one       bucket_cap_mb=100: one bucket, reduced only when backward has finished: nothing overlaps
    small     bucket_cap_mb=0.001: a bucket closes at every tensor past 1 KB  -> 5 smaller all_reduces
    no_sync   two micro-batches inside no_sync() (no communication at all), then a synced one
(Passing bucket_cap_mb=25 explicitly is NOT the default: an explicit cap applies to the first bucket too.)
For each variant: warm-up steps (DDP settles its buckets after the first), then ONE step under
torch.profiler on every rank -> OUT/trace_<variant>_rank<r>.json (open in https://ui.perfetto.dev), and
from rank 0's trace OUT/overlap_<variant>.png and OUT/overlap_all.png: compute kernels in one lane,
NCCL kernels in another, backward shaded; plus how much NCCL time ran while compute kernels ran.
On the CPU (gloo) there are no CUDA streams: the lanes are the main thread's operators and gloo's threads.
"""
import argparse
import datetime
import gc
import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's engine prints start/stop lines; 0 shows them again
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder, for common/
from common.model import Net  # noqa: E402

# name -> (bucket_cap_mb, micro-batches: True = synced). None = DDP's default.
VARIANTS = {"default": (None, [True]), "one": (100, [True]), "small": (0.001, [True]),
            "no_sync": (None, [False, False, True])}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda:LOCAL_RANK with NCCL if there are GPUs, else the CPU with gloo (default: auto)")
    p.add_argument("--batch-size", type=int, default=512, help="images per micro-batch per process (default: 512)")
    p.add_argument("--warmup-steps", type=int, default=5,
                   help="steps before the profiled one, at least 2: DDP re-buckets at the 2nd (default: 5)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--out", default="runs/ddp_overlap",
                   help="folder for traces, pictures and overlap.json (default: runs/ddp_overlap)")
    p.add_argument("--render-only", action="store_true", help="no training: redraw the pictures from the traces in --out")
    args = p.parse_args()
    args.variants = args.variants.split(",")
    if args.warmup_steps < 2:
        p.error("--warmup-steps must be at least 2: DDP rebuilds its buckets (with a broadcast) in the 2nd step")
    if unknown := set(args.variants) - set(VARIANTS):
        p.error(f"unknown variant(s) {', '.join(sorted(unknown))}: choose from {', '.join(VARIANTS)}")
    return args


def setup(requested: str) -> torch.device:
    use_cuda = requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    timeout, device_id = datetime.timedelta(minutes=5), device if use_cuda else None
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout, device_id=device_id)
    else:  # a group of one: runs, but there is nothing to overlap
        dist.init_process_group("nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout, device_id=device_id)
    return device


def profile_one_step(variant: str, device, args) -> str:
    """Warm up, then profile ONE optimizer step of `variant` into OUT/trace_<variant>_rank<r>.json.

    Returns DDP's bucket sizes (bytes, in the order they are all_reduced), from its debugging log."""
    cap, micro_batches = VARIANTS[variant]
    torch.manual_seed(0)
    model = DDP(Net().to(device), device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=cap)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
    x = torch.randn(args.batch_size, 1, 28, 28, device=device)  # data already on the device: no input pipeline
    y = torch.randint(0, 10, (args.batch_size,), device=device)

    def step():
        for i, sync in enumerate(micro_batches):
            tag = "" if sync else " (no_sync)"
            with nullcontext() if sync else model.no_sync():  # no_sync: keep the gradients local, no all_reduce
                with record_function(f"forward {i}{tag}"):
                    loss = F.nll_loss(model(x), y)
                with record_function(f"backward {i}{tag}"):
                    loss.backward()  # DDP's hooks all_reduce each bucket as soon as it is complete
        with record_function("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup_steps):
        step()
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        dist.barrier()  # the profiler starts at different moments on the ranks: start the step together
        if cuda:
            torch.cuda.synchronize(device)
        with record_function("step"):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    prof.export_chrome_trace(f"{args.out}/trace_{variant}_rank{dist.get_rank()}.json")
    try:  # DDP's own debugging log (a private API): the bucket sizes after its rebuild
        return str(model._get_ddp_logging_data().get("rebuilt_bucket_sizes", "?"))
    except Exception:
        return "?"


def union(intervals):
    """Sorted, merged (start, end) intervals."""
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def length(intervals) -> float:
    return sum(e - s for s, e in union(intervals))


def intersection(a, b) -> float:
    """Total length of time covered by both interval sets."""
    total, b = 0.0, union(b)
    for s, e in union(a):
        total += sum(max(0.0, min(e, be) - max(s, bs)) for bs, be in b)
    return total


def lanes(trace_path: str) -> dict:
    """From a chrome trace: {lane: [(start_ms, end_ms)]}, the backward spans and the step's length, in ms from its start.

    A trace with CUDA kernels gives a compute-kernel lane and an NCCL-kernel lane; a CPU-only trace the
    main thread's operators and gloo's collectives."""
    events = [e for e in json.loads(Path(trace_path).read_text())["traceEvents"] if e.get("ph") == "X"]
    cuda = any(e.get("cat") == "kernel" for e in events)
    marks = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "user_annotation"}
    t0, t1 = marks["step"]
    span = lambda e: ((e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3)  # noqa: E731
    backward_cpu = [w for name, w in marks.items() if name.startswith("backward")]
    if cuda:
        kernels = [e for e in events if e.get("cat") == "kernel" and e["ts"] >= t0]
        comm = [span(e) for e in kernels if "nccl" in e["name"].lower()]
        compute = [span(e) for e in kernels if "nccl" not in e["name"].lower()]
        # Backward on the GPU: the compute kernels launched while backward() ran on the CPU (the launch and
        # the kernel share a correlation id). The GPU runs them later than the CPU queues them.
        correlation = lambda e: e.get("args", {}).get("correlation")  # noqa: E731
        launched = [(e["ts"], correlation(e)) for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
        backward = []
        for b0, b1 in backward_cpu:
            ids = {c for ts, c in launched if b0 <= ts <= b1}
            mine = [span(e) for e in kernels if correlation(e) in ids and "nccl" not in e["name"].lower()]
            backward.append((min(s for s, _ in mine), max(e for _, e in mine)) if mine
                            else span({"ts": b0, "dur": b1 - b0}))
        names = ("compute kernels", "NCCL kernels")
    else:
        main_tid = next(e["tid"] for e in events if e.get("name") == "step")
        ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e["tid"] == main_tid and t0 <= e["ts"] <= t1),
                     key=lambda e: e["ts"])
        compute, end = [], -1.0
        for e in ops:  # top-level operators only: a nested one lies inside its parent
            if e["ts"] >= end and not e["name"].startswith("c10d::"):
                compute.append(span(e))
                end = e["ts"] + e["dur"]
        comm = [span(e) for e in events if e["name"].startswith(("gloo:", "nccl:"))  # the backends' own annotations
                and e["ts"] + e["dur"] >= t0 and e["ts"] <= t1]
        backward = [span({"ts": b0, "dur": b1 - b0}) for b0, b1 in backward_cpu]
        names = ("CPU operators (main thread)", "collectives (backend threads)")
    end = max([e for _, e in compute + comm] + [(t1 - t0) / 1e3])
    return {"lanes": dict(zip(names, (compute, comm))), "backward": backward, "step_ms": end}


def overlap_numbers(info: dict) -> dict:
    compute, comm = info["lanes"].values()
    comm_ms, hidden_ms = length(comm), intersection(comm, compute)
    return {"step_ms": info["step_ms"], "backward_ms": length(info["backward"]), "comm_kernels": len(comm),
            "comm_ms": comm_ms, "overlapped_ms": hidden_ms, "exposed_ms": comm_ms - hidden_ms}


def draw(ax, variant: str, info: dict, numbers: dict) -> None:
    for s, e in info["backward"]:
        ax.axvspan(s, e, color="0.88", zorder=0)
    colors = ("tab:blue", "tab:orange")
    for row, ((name, spans), color) in enumerate(zip(info["lanes"].items(), colors)):
        ax.broken_barh([(s, max(e - s, info["step_ms"] / 2000)) for s, e in spans], (row - 0.4, 0.8), color=color)
    ax.set_yticks([0, 1], list(info["lanes"]))
    ax.set_ylim(-0.7, 1.7)
    ax.set_xlim(0, info["step_ms"] * 1.02)
    ax.set_title(f"{variant}: {numbers['comm_kernels']} all_reduce(s), {numbers['comm_ms']:.3f} ms of communication, "
                 f"{numbers['overlapped_ms']:.3f} ms of it under compute (grey: backward)", fontsize=9, loc="left")


def render(results: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    for variant, (info, numbers) in results.items():
        fig, ax = plt.subplots(figsize=(11, 2.4), layout="constrained")
        draw(ax, variant, info, numbers)
        ax.set_xlabel("ms from the start of the step (rank 0)")
        fig.savefig(out / f"overlap_{variant}.png", dpi=120)
        plt.close(fig)
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.2 * len(results)), layout="constrained", squeeze=False)
    for ax, (variant, (info, numbers)) in zip(axes[:, 0], results.items()):
        draw(ax, variant, info, numbers)
    axes[-1, 0].set_xlabel("ms from the start of the step (rank 0)")
    fig.savefig(out / "overlap_all.png", dpi=120)
    plt.close(fig)


def report(out: Path, variants, buckets: dict, header: str) -> None:
    """Rank 0's traces in OUT -> the overlap table, overlap.json and the pictures."""
    print(header)
    print(f"{'variant':<9} {'bucket bytes':<40} {'all_reduces':>11} {'comm ms':>8} {'overlapped ms':>14} "
          f"{'exposed ms':>10} {'backward ms':>11} {'step ms':>8}")
    results = {}
    for variant in variants:
        info = lanes(str(out / f"trace_{variant}_rank0.json"))
        numbers = {**overlap_numbers(info), "buckets": buckets.get(variant, "?")}
        results[variant] = (info, numbers)
        share = numbers["overlapped_ms"] / numbers["comm_ms"] if numbers["comm_ms"] else 0.0
        print(f"{variant:<9} {numbers['buckets']:<40} {numbers['comm_kernels']:>11} {numbers['comm_ms']:>8.3f} "
              f"{numbers['overlapped_ms']:>8.3f} ({share:>3.0%}) {numbers['exposed_ms']:>10.3f} "
              f"{numbers['backward_ms']:>11.3f} {numbers['step_ms']:>8.3f}", flush=True)
    (out / "overlap.json").write_text(json.dumps({"header": header, "variants": {v: n for v, (_, n) in results.items()}},
                                                 indent=1) + "\n")
    try:
        render(results, out)
    except ImportError:  # the pictures can be drawn anywhere later: --render-only OUT
        print(f"matplotlib is not installed: no pictures; copy {out} elsewhere and run "
              f"`python benchmarks/ddp_overlap.py --render-only --out {out}`")
        return
    print(f"pictures: {out}/overlap_<variant>.png, {out}/overlap_all.png; traces: {out}/trace_<variant>_rank<r>.json")


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    if args.render_only:  # no processes, no GPUs: redraw from the traces a run left in OUT
        saved = json.loads((out / "overlap.json").read_text()) if (out / "overlap.json").exists() else {}
        variants = [v for v in VARIANTS if (out / f"trace_{v}_rank0.json").exists()]
        if not variants:
            sys.exit(f"error: no trace_<variant>_rank0.json in {out}")
        buckets = {v: n.get("buckets", "?") for v, n in saved.get("variants", {}).items()}
        report(out, variants, buckets, saved.get("header", f"traces in {out}"))
        return
    device = setup(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    out.mkdir(parents=True, exist_ok=True)
    buckets = {variant: profile_one_step(variant, device, args) for variant in args.variants}
    dist.barrier()  # every rank has written its traces
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        report(out, args.variants, buckets, f"{world} rank(s) on {name} ({dist.get_backend()}), batch "
                                            f"{args.batch_size} per micro-batch, torch {torch.__version__}; "
                                            f"rank 0's profiled step:")
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()  # free gloo's last buffers while Python is alive (troubleshooting/README.md: teardown)


if __name__ == "__main__":
    main()

"""The plain training loop lesson 04 is measured against: MNIST resident on the GPUs, no DataLoader, no extras.

    python benchmarks/plain_loop.py --data-dir DIR                                   # one process (GPU or CPU)
    torchrun --standalone --nproc_per_node=2 benchmarks/plain_loop.py --data-dir DIR --seeds 1,2,3 --json OUT.json
    torchrun --standalone --nproc_per_node=2 benchmarks/plain_loop.py --data-dir DIR --profile --out OUT

The whole training set sits on every GPU as one tensor. Each epoch draws one random permutation (the
same on every rank, from the seed) and rank r trains on every world_size-th image of it, 512 per step.
AdamW + OneCycle; DDP when torchrun starts one process per GPU. The clock runs around training steps
only: untimed warm-up steps on random images first pay the one-off costs (CUDA kernels, cuDNN
autotuning, NCCL connections), on a throwaway model, so they change no result.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # --profile: the profiler's engine prints start/stop lines; 0 shows them
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder, for common/
from common.data import MNIST_MEAN, MNIST_STD, dataset_root, prepare_data  # noqa: E402
from common.model import Net  # noqa: E402


def seed_list(text: str) -> list[int]:
    return [int(seed) for seed in text.split(",")]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", choices=["mnist", "synthetic"], default="mnist",
                   help="real MNIST or the synthetic set (default: mnist)")
    p.add_argument("--data-dir", default=os.environ.get("WORKSHOP_DATA_DIR") or "./data",
                   help="folder holding MNIST/raw, .gz files are extracted (default: $WORKSHOP_DATA_DIR or ./data)")
    p.add_argument("--train-samples", type=int, default=None, help="use the first N training images (default: all)")
    p.add_argument("--test-samples", type=int, default=None, help="use the first N test images (default: all)")
    p.add_argument("--batch-size", type=int, default=512, help="images per step PER PROCESS (default: 512)")
    p.add_argument("--epochs", type=int, default=5, help="length of the OneCycle schedule (default: 5)")
    p.add_argument("--max-lr", type=float, default=6e-3, help="OneCycle's peak learning rate (default: 6e-3)")
    p.add_argument("--target-accuracy", type=float, default=0.99, help="stop after the first epoch reaching it (default: 0.99)")
    p.add_argument("--seeds", type=seed_list, default="1", help="comma-separated seeds, one full run each (default: 1)")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps per batch shape before the runs (default: 3)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda:LOCAL_RANK if there is a GPU (default: auto)")
    p.add_argument("--json", default=None, help="write the results here, rank 0 (default: none)")
    p.add_argument("--profile", action="store_true", help="profile 20 steps first: print the top operators, save a chrome trace")
    p.add_argument("--out", default="runs/plain_loop", help="folder for the --profile trace (default: runs/plain_loop)")
    return p.parse_args()


def load(args, device, rank: int, world: int):
    """(train images, train labels, test images, test labels) as normalised tensors on `device`."""
    failure = None
    if rank == 0:  # only rank 0 touches the files (extracts .gz files if that is all there is)
        try:
            prepare_data(args.data_dir, args.data, download=False)
        except Exception as e:  # a CourseError naming the fix
            failure = e
    failed = torch.tensor([float(failure is not None)], device=device)
    if world > 1:
        dist.all_reduce(failed)  # also the barrier: the others wait until rank 0 has the files ready
    if failed.item():  # rank 0 says why; every rank stops
        if failure:
            print(f"error: {failure}", file=sys.stderr, flush=True)
        sys.exit(2)
    root = str(dataset_root(args.data_dir, args.data))
    out = []
    for train, n in ((True, args.train_samples), (False, args.test_samples)):
        ds = torchvision.datasets.MNIST(root, train=train, download=False)
        images = ds.data[:n].unsqueeze(1).float().div(255).sub(MNIST_MEAN).div(MNIST_STD)  # = ToTensor + Normalize
        out += [images.to(device), ds.targets[:n].to(device)]
    return out


def make(device, world: int, steps_total: int, args):
    """A fresh Net (wrapped in DDP when there are several processes), its AdamW and its OneCycle schedule."""
    model = Net().to(device)
    if world > 1:  # DDP broadcasts rank 0's weights now, and all_reduces the gradients in backward()
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.max_lr, weight_decay=0.01, fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.max_lr, total_steps=steps_total,
                                                pct_start=0.25, cycle_momentum=False)
    return model, opt, sched


def step(model, opt, sched, x, y) -> None:
    loss = F.nll_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()


@torch.no_grad()
def accuracy(model, x, y, world: int) -> float:
    """This rank's share of the test set (every world_size-th image), counts summed over the ranks."""
    net = model.module if isinstance(model, DDP) else model  # no DDP hooks: the ranks' shares may differ
    net.eval()
    counts = torch.zeros(2, device=x.device)
    for i in range(0, len(x), 2000):
        counts[0] += (net(x[i:i + 2000]).argmax(1) == y[i:i + 2000]).sum()
    counts[1] = len(x)
    if world > 1:
        dist.all_reduce(counts)
    net.train()
    return (counts[0] / counts[1]).item()


def now(device) -> float:
    """Seconds, once the GPU has finished what was queued (else we would time the launches only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def train_epoch(model, opt, sched, x, y, mine, args) -> list[float]:
    """One epoch over this rank's indices `mine`; returns the milliseconds of each step."""
    if x.is_cuda:  # CUDA events time each step on the GPU without stopping the CPU from queueing the next
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(-(-len(mine) // args.batch_size) + 1)]
        marks[0].record()
    times, last = [], time.perf_counter()
    for k, i in enumerate(range(0, len(mine), args.batch_size), 1):
        idx = mine[i:i + args.batch_size]
        step(model, opt, sched, x[idx], y[idx])
        if x.is_cuda:
            marks[k].record()
        else:  # on the CPU every operation has finished when it returns
            times.append((time.perf_counter() - last) * 1e3)
            last = time.perf_counter()
    if x.is_cuda:
        marks[-1].synchronize()
        times = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    return times


def run_seed(seed, data, device, rank, world, args, say) -> dict:
    x, y, x_test, y_test = data
    per_rank = len(x) // world  # equal shares: DDP needs the same number of steps on every rank
    torch.manual_seed(seed)
    model, opt, sched = make(device, world, -(-per_rank // args.batch_size) * args.epochs, args)
    step_ms, epoch_s, epoch_ms, accs = [], [], [], []
    for epoch in range(args.epochs):
        g = torch.Generator().manual_seed(seed * 1000 + epoch)  # the same permutation on every rank
        mine = torch.randperm(len(x), generator=g)[rank::world][:per_rank].to(device)
        start = now(device)
        times = train_epoch(model, opt, sched, x, y, mine, args)
        epoch_s.append(now(device) - start)
        step_ms += times
        epoch_ms.append(statistics.median(times))
        accs.append(accuracy(model, x_test, y_test, world))
        say(f"seed {seed} epoch {epoch + 1}: {epoch_s[-1]:.3f} s ({len(times)} steps, median "
            f"{epoch_ms[-1]:.2f} ms/step), test accuracy {accs[-1]:.4f}")
        if accs[-1] >= args.target_accuracy:
            break
    reached = accs[-1] >= args.target_accuracy
    return {"seed": seed, "epochs": len(accs), "accuracy": accs, "epoch_seconds": epoch_s, "epoch_ms_per_step": epoch_ms,
            "ms_per_step": statistics.median(step_ms), "s_per_epoch": statistics.median(epoch_s),
            "time_to_target_s": sum(epoch_s) if reached else None, "final_accuracy": accs[-1], "reached_target": reached}


def warm_up(data, device, world, args) -> tuple:
    """Untimed steps on a throwaway model, random images, at both batch shapes (the last batch may be smaller)."""
    start, per_rank = time.perf_counter(), len(data[0]) // world
    model, opt, sched = make(device, world, 10**6, args)
    for size in {args.batch_size, per_rank % args.batch_size or args.batch_size}:
        for _ in range(args.warmup_steps):
            step(model, opt, sched, torch.randn(size, 1, 28, 28, device=device), torch.randint(0, 10, (size,), device=device))
    return now(device) - start, (model, opt, sched)


def profile_steps(trio, data, device, rank, args, say) -> None:
    """20 steps of real images under torch.profiler: the top operators, and a chrome trace per rank."""
    x, y, cuda = data[0], data[1], device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for i in range(20):
            idx = torch.arange(i * args.batch_size, (i + 1) * args.batch_size, device=device) % len(x)
            step(*trio, x[idx], y[idx])
        now(device)
    say(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=15))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(f"{args.out}/plain_loop_trace_rank{rank}.json")
    say(f"chrome trace: {args.out}/plain_loop_trace_rank{rank}.json (open it in https://ui.perfetto.dev)")


def main() -> None:
    args = parse_args()
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # fixed shapes: cuDNN times its convolution algorithms once
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # as the lessons do: float32 matmuls on tensor cores
    if "RANK" in os.environ:  # torchrun: one process per GPU
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    say = (lambda text: print(text, flush=True)) if rank == 0 else (lambda text: None)
    data = load(args, device, rank, world)
    if -(-(len(data[0]) // world) // args.batch_size) * args.epochs < 8:  # OneCycle's warm-up needs > 1 step
        if rank == 0:
            print("error: fewer than 8 steps in the whole run: raise --train-samples or --epochs, or lower --batch-size",
                  file=sys.stderr, flush=True)
        sys.exit(2)
    n_test = len(data[2])
    data[2], data[3] = data[2][rank::world].contiguous(), data[3][rank::world]  # this rank's test share
    warmup_s, throwaway = warm_up(data, device, world, args)
    if args.profile:
        profile_steps(throwaway, data, device, rank, args, say)
    runs = [run_seed(seed, data, device, rank, world, args, say) for seed in args.seeds]
    for r in runs:
        ttt = f"{r['time_to_target_s']:.3f} s" if r["reached_target"] else "not reached"
        say(f"seed {r['seed']}: time to {args.target_accuracy:.2%}: {ttt} in {r['epochs']} epoch(s), final accuracy "
            f"{r['final_accuracy']:.4f}, {r['ms_per_step']:.2f} ms/step, {r['s_per_epoch']:.3f} s/epoch")
    if rank == 0 and args.json:
        result = {"script": "benchmarks/plain_loop.py", "world_size": world, "device": device.type,
                  "gpu": torch.cuda.get_device_name(device) if use_cuda else None, "torch": torch.__version__,
                  "data": args.data, "train_samples": len(data[0]), "test_samples": n_test,
                  "batch_per_process": args.batch_size, "global_batch": args.batch_size * world,
                  "target_accuracy": args.target_accuracy, "warmup_s": warmup_s, "runs": runs}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()  # free gloo's last buffers while Python is alive (troubleshooting/README.md: teardown)


if __name__ == "__main__":
    main()

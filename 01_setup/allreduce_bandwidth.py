"""Is my interconnect healthy? all_reduce bandwidth over message sizes, read like nccl-tests' all_reduce_perf.

    torchrun --standalone --nproc_per_node=4 01_setup/allreduce_bandwidth.py              # GPUs, NCCL, 4K..256M
    torchrun --standalone --nproc_per_node=2 01_setup/allreduce_bandwidth.py --device cpu --max-bytes 64M
    torchrun --standalone --nproc_per_node=2 01_setup/allreduce_bandwidth.py --json bw.json  # rows for the benchmarks

One process per GPU. For each size (powers of 2 from --min-bytes to --max-bytes) every rank sums a
float32 tensor of that size with the others: one all_reduce whose result is checked, --warmup untimed
ones, then --iters timed ones. The time of a size is the mean time per all_reduce of the SLOWEST rank
(a collective is finished when the last rank has it). Columns, as nccl-tests prints them:
    algbw = bytes / time                 the speed your code sees: "my 100 MB of gradients take X ms"
    busbw = algbw * 2(n-1)/n             what each rank's link carries: compare THIS with the link's speed
Small messages measure latency (time stays flat as the size grows); large ones measure bandwidth.
"""
import argparse
import datetime
import gc
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
FLOAT32 = 4  # bytes per element


class FlagError(Exception):
    """A bad command line: one line on stderr, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage block first; we want one line
        raise FlagError(message)


def parse_size(text: str) -> int:
    """'4096', '4K', '256M', '1G' (binary units, an optional trailing B) -> bytes."""
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = value[-1] if value and value[-1] in "KMG" else ""
    try:
        number = int(value[:-1] if unit else value)
    except ValueError:
        raise FlagError(f"size {text!r} is not a number of bytes like 4096, 4K, 256M or 1G") from None
    return number * UNITS[unit]


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-bytes", default="4K", help="smallest message, e.g. 4096, 4K, 1M (default: 4K)")
    p.add_argument("--max-bytes", default="256M", help="largest message; sizes double up to it (default: 256M)")
    p.add_argument("--iters", type=int, default=20, help="timed all_reduces per size (default: 20)")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed all_reduces per size first: NCCL sets up buffers and channels on first use (default: 5)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: one GPU per process with NCCL if there are GPUs, else the CPU with gloo (default: auto)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file (rank 0) (default: none)")
    args = p.parse_args(argv)
    args.min_bytes, args.max_bytes = parse_size(args.min_bytes), parse_size(args.max_bytes)
    for name in ("min_bytes", "max_bytes"):
        value = getattr(args, name)
        if value < FLOAT32 or value % FLOAT32:
            raise FlagError(f"--{name.replace('_', '-')} must be a positive multiple of 4 bytes (float32), got {value}")
    if args.min_bytes > args.max_bytes:
        raise FlagError(f"--min-bytes ({args.min_bytes}) is larger than --max-bytes ({args.max_bytes})")
    if args.iters < 1 or args.warmup < 0:
        raise FlagError(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    return args


def message_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    sizes = [min_bytes]
    while sizes[-1] * 2 <= max_bytes:
        sizes.append(sizes[-1] * 2)
    return sizes


def bus_bandwidth(algbw: float, n: int) -> float:
    """What each rank's link carries per second during an all_reduce of algbw bytes/s over n ranks.

    A ring all_reduce is a reduce-scatter (each rank sends (n-1)/n of the message, one chunk per hop)
    followed by an all-gather (another (n-1)/n): every link carries 2(n-1)/n times the message. So
    busbw = algbw * 2(n-1)/n is the number to compare with the link's speed, whatever n is
    (nccl-tests, doc/PERFORMANCE.md; it holds for NCCL's tree algorithm too). One rank: 0, no link.
    """
    return algbw * 2 * (n - 1) / n


def setup(requested: str) -> torch.device:
    """One process per GPU (cuda:LOCAL_RANK) with NCCL, or the CPU with gloo; a group of one without torchrun."""
    use_cuda = requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise FlagError("--device cuda but no CUDA GPU is visible: run on a GPU node or use --device cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        if device.index >= torch.cuda.device_count():
            raise FlagError(f"LOCAL_RANK {device.index} but only {torch.cuda.device_count()} GPU(s) visible: "
                            f"--nproc_per_node must not exceed the GPUs per node")
        torch.cuda.set_device(device)  # this process uses this GPU, and only this one
    backend = "nccl" if use_cuda else "gloo"
    timeout = datetime.timedelta(minutes=5)
    device_id = device if use_cuda else None  # binds the group to this GPU now: no "guessing device ID"
    if "RANK" in os.environ:  # torchrun: env:// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    else:  # plain `python`: a group of one, in memory (no port needed)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                device_id=device_id)
    return device


def timed(buf: torch.Tensor, iters: int) -> float:
    """Mean seconds per all_reduce of `buf` on this rank."""
    if buf.is_cuda:
        # CUDA events are recorded on the GPU stream: they time the work itself, not the CPU launching it.
        # all_reduce (async_op=False) makes the current stream wait for NCCL's, so `end` follows the last one.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dist.all_reduce(buf)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters  # elapsed_time is in ms
    begin = time.perf_counter()  # gloo's all_reduce returns when the result is there
    for _ in range(iters):
        dist.all_reduce(buf)
    return (time.perf_counter() - begin) / iters


def measure(size: int, args, device: torch.device) -> dict:
    n, rank = dist.get_world_size(), dist.get_rank()
    count = size // FLOAT32
    # Correctness, once: rank r contributes r+1 everywhere, so every element must be 1 + 2 + ... + n.
    buf = torch.full((count,), float(rank + 1), dtype=torch.float32, device=device)
    dist.all_reduce(buf)
    wrong = torch.tensor([float((buf != n * (n + 1) / 2).sum())], device=device)
    buf.zero_()  # the values do not change the time; zeros keep repeated sums from overflowing
    for _ in range(args.warmup):
        dist.all_reduce(buf)
    dist.barrier()  # start the clock together: a rank that starts late would make the others wait
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = torch.tensor([timed(buf, args.iters)], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank decides
    dist.all_reduce(wrong)
    t = seconds.item()
    algbw = size / t / 1e9
    busbw = bus_bandwidth(algbw, n)
    return {"bytes": size, "count": count, "time_us": t * 1e6, "algbw_gbps": algbw, "busbw_gbps": busbw,
            "wrong": int(wrong.item())}


def describe(device: torch.device) -> dict:
    info = {"world_size": dist.get_world_size(), "backend": dist.get_backend(), "device": device.type,
            "host": socket.gethostname(), "torch": torch.__version__, "dtype": "float32", "op": "sum"}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def main(argv=None) -> int:
    args = parse_args(argv)
    device = setup(args.device)
    info = describe(device)
    rank, n = dist.get_rank(), info["world_size"]
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"# all_reduce of float32, {n} rank(s), backend {info['backend']}, {info.get('gpu', 'CPU')} on host "
        f"{info['host']}, torch {info['torch']}" + (f", NCCL {info['nccl']}" if "nccl" in info else ""))
    say(f"# {args.warmup} warm-up + {args.iters} timed all_reduces per size; time = slowest rank's mean; "
        f"busbw = algbw * 2(n-1)/n = algbw * {bus_bandwidth(1.0, n):.2f}")
    say(f"#{'size (B)':>12} {'count':>11} {'time (us)':>11} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13} {'#wrong':>7}",
        flush=True)
    if n == 1:
        say("# one rank: nothing crosses a link, so busbw is 0; launch with torchrun --nproc_per_node=2 or more")
    rows = []
    for size in message_sizes(args.min_bytes, args.max_bytes):
        row = measure(size, args, device)
        rows.append(row)
        say(f" {row['bytes']:>12} {row['count']:>11} {row['time_us']:>11.1f} {row['algbw_gbps']:>13.3f} "
            f"{row['busbw_gbps']:>13.3f} {row['wrong']:>7}", flush=True)
    peak = max(rows, key=lambda r: r["busbw_gbps"])
    say(f"# avg bus bandwidth: {sum(r['busbw_gbps'] for r in rows) / len(rows):.3f} GB/s over {len(rows)} sizes; "
        f"peak {peak['busbw_gbps']:.3f} GB/s at {peak['bytes']} bytes", flush=True)
    bad = sum(r["wrong"] for r in rows)
    if bad:
        say(f"FAILED: {bad} wrong elements summed over the ranks: the interconnect or the driver corrupts data",
            flush=True)
    if rank == 0 and args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**info, "iters": args.iters, "warmup": args.warmup,
                                               "rows": rows}, indent=1) + "\n")
    dist.destroy_process_group()
    gc.collect()  # free gloo's last buffers while Python is alive (see troubleshooting/README.md: teardown)
    return 1 if bad else 0


def cli(argv=None) -> int:
    """main(), with a bad flag reported in one line (exit code 2) instead of a traceback."""
    try:
        return main(argv)
    except FlagError as e:
        if os.environ.get("RANK", "0") == "0":  # every rank read the same flags: one of them says so
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(cli())

"""Benchmark the lessons on 1..N GPUs (or, with --quick, on CPU) and write docs/benchmarks.md, .json and plots.

    make bench                               # every suite, 1 and 2 GPUs (4, 8 if present): ~13 min on 2 GPUs
    python benchmarks/bench.py --suite recipe,classic,scaling,throughput --data-dir DIR --out OUT   # ~6 min
    python benchmarks/bench.py --suite dp,memory --data-dir DIR --out OUT                          # ~7 min
    python benchmarks/bench.py --report-only --merge A/benchmarks.json B/benchmarks.json --out docs
    python benchmarks/bench.py --plan [--suite ...]   # the runs and their estimated seconds; runs nothing
    python benchmarks/bench.py --quick               # CPU smoke mode (gloo, synthetic, tiny), for the tests

Every run is the real lesson script (python or torchrun) in a fresh output folder; its metrics.json becomes a
row. Rows are merged into OUT/benchmarks.json after EVERY run (keyed by suite, lesson, GPUs, variant and
data, so a re-run replaces the same measurement and a 4-GPU machine adds rows): a command killed at its
time limit still leaves what it measured. A run that fails or passes --run-timeout is recorded as failed,
with the last lines of its output, and the suite goes on.

GPU time, estimated from platform.md (02 DataLoader 2.46 s/epoch, 04 DataLoader 1.45 s/epoch on 2 GPUs,
on-device 512: 0.27 s/epoch on 1 GPU, 0.14 s on 2; 05 ~3.5x 04; process start 10-15 s) for 1 and 2 GPUs:
    recipe 6 runs ~1.4 min, classic 2 runs ~1.7 min, scaling 4 runs ~1 min, throughput 8 runs ~2 min,
    dp 2 runs ~0.5-1.5 min (DataParallel without peer access: ~0.3 s a step), memory 16 runs ~5.3 min.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.report import load_rows, machine_info, save_rows, write_report  # noqa: E402
from benchmarks.rows import from_metrics, summary  # noqa: E402

SCRIPTS = {"02": "02_singlegpu_training/mnist_singlegpu.py", "03": "03_dp_training/mnist_dpmodel.py",
           "04": "04_ddp_training/mnist_ddpmodel.py", "05": "05_multigpu_fsdp_training/mnist_fsdpmodel.py"}
SUITES = ("recipe", "classic", "scaling", "dp", "throughput", "memory")  # run in this order

# Time to 99%: lesson 04, data on the GPUs, AdamW + OneCycle (pct_start 0.25 when --warmup-steps is 0),
# 512 per GPU, no lr scaling, untimed warm-up; it stops at the first epoch reaching the target. Change it here.
RECIPE = ["--data-on-device", "--batch-size", "512", "--optimizer", "adamw", "--lr", "6e-3",
          "--schedule", "onecycle", "--epochs", "5", "--target-accuracy", "0.99"]
RECIPE_SEEDS = (1, 2, 3)
# Large-batch scaling: the classic Adadelta at a FIXED 512 per GPU (the global batch grows with the GPUs).
SCALING = {"none": ["--lr-scaling", "none"], "linear": ["--lr-scaling", "linear", "--warmup-steps", "100"]}
SCALING_FLAGS = ["--data-on-device", "--batch-size", "512", "--epochs", "6"]
MEMORY_WIDTHS = (1, 10, 4, 8)
# Test batch = train batch: evaluation keeps no activations for backward, so with it no larger the peak is training's.
MEMORY_FLAGS = ["--data-on-device", "--batch-size", "512", "--test-batch-size", "512",
                "--epochs", "1", "--max-steps", "30"]
DP_STEPS = 100  # DataParallel ran at ~450 img/s on a host without peer access: a full epoch would take minutes

# --quick: the same plan shrunk to seconds on the CPU. Synthetic digits are easy, 0.5 is reached in an epoch or two.
QUICK_SAMPLES = ["--train-samples", "512", "--test-samples", "256", "--num-workers", "0"]
QUICK_VALUES = {"--batch-size": {"512": "64", "128": "64", "64": "32"}, "--epochs": lambda v: str(min(int(v), 2)),
                "--target-accuracy": lambda v: "0.5", "--warmup-steps": lambda v: "4",
                "--max-steps": lambda v: str(min(int(v), 4))}


def cfg(suite, lesson, gpus, variant, flags, path="on-device", bs=512, width=1, precision="fp32", seed=1, nproc=None):
    return dict(suite=suite, lesson=lesson, gpus=gpus, nproc=gpus if nproc is None else nproc, variant=variant,
                flags=[str(f) for f in flags], path=path, bs=bs, width=width, precision=precision, seed=seed)


def plan(suites, gpus: list[int], quick: bool) -> list[dict]:
    """The runs of the chosen suites. bs is per GPU (lesson 03: per GPU of its one process)."""
    runs, multi = [], [n for n in gpus if n >= 2]
    if "recipe" in suites:
        for n in ([1] if quick else gpus):  # quick: one seed on one process keeps the test short
            for seed in (RECIPE_SEEDS[:1] if quick else RECIPE_SEEDS):
                runs.append(cfg("recipe", "04", n, f"seed{seed}", RECIPE + ["--seed", seed], seed=seed))
    if "classic" in suites:  # the pytorch/examples default: DataLoader, batch 64, Adadelta, 14 epochs
        runs.append(cfg("classic", "02", 1, "default", ["--epochs", 14], path="dataloader", bs=64))
        if multi and not quick:
            runs.append(cfg("classic", "04", 2, "default", ["--epochs", 14], path="dataloader", bs=64))
    if "scaling" in suites:
        for n in ([1] if quick else gpus):
            for name, extra in (list(SCALING.items())[-1:] if quick else SCALING.items()):
                runs.append(cfg("scaling", "04", n, f"lr-{name}", SCALING_FLAGS + extra))
    if "dp" in suites and (multi or quick):  # one process; CUDA_VISIBLE_DEVICES decides how many GPUs it drives
        dp = ["--epochs", 1, "--max-steps", DP_STEPS]
        runs.append(cfg("dp", "03", 2, "dataloader", dp + ["--batch-size", 128], path="dataloader", bs=64, nproc=1))
        if not quick:  # the same script on one GPU: what DataParallel should beat
            runs.append(cfg("dp", "03", 1, "dataloader", dp + ["--batch-size", 64], path="dataloader", bs=64, nproc=1))
    if "throughput" in suites:
        if not quick:
            runs.append(cfg("throughput", "02", 1, "dataloader", ["--batch-size", 64, "--epochs", 2],
                            path="dataloader", bs=64))
            runs.append(cfg("throughput", "02", 1, "on-device", ["--data-on-device", "--batch-size", 512, "--epochs", 3]))
        for n in ([1] if quick else gpus):  # quick: the 2-process path is covered by the memory run
            if not quick:
                runs.append(cfg("throughput", "04", n, "dataloader", ["--batch-size", 64, "--epochs", 2],
                                path="dataloader", bs=64))
            runs.append(cfg("throughput", "04", n, "on-device", ["--data-on-device", "--batch-size", 512, "--epochs", 3]))
            if not quick:
                runs.append(cfg("throughput", "05", n, "on-device", ["--data-on-device", "--batch-size", 512,
                                                                     "--epochs", 3]))
    if "memory" in suites and (multi or quick):  # like for like: DDP and FSDP at the same precision
        for width in ((1,) if quick else MEMORY_WIDTHS):  # widths in order of interest: a --budget cuts the last
            for precision in (("fp32",) if quick else ("fp32", "bf16")):
                for lesson in (("05",) if quick else ("04", "05")):
                    amp = ["--amp"] if precision == "bf16" else []
                    runs.append(cfg("memory", lesson, 2, f"w{width}-{precision}", MEMORY_FLAGS + ["--width", width] + amp,
                                    width=width, precision=precision))
    return runs


def shrink(flags: list[str]) -> list[str]:
    """--quick: the same flags with CPU-sized values."""
    out = list(flags)
    for i in range(len(out) - 1):
        rule = QUICK_VALUES.get(out[i])
        if isinstance(rule, dict):
            out[i + 1] = rule.get(out[i + 1], out[i + 1])
        elif rule:
            out[i + 1] = rule(out[i + 1])
    return out


def estimate_seconds(c: dict) -> float:
    """A rough GPU estimate from platform.md, for --plan and --budget (real MNIST, H100/H200)."""
    f = dict(zip(c["flags"], c["flags"][1:]))
    epochs, start = int(f.get("--epochs", 14)), (10 if c["nproc"] == 1 else 15)
    if c["suite"] == "memory":
        return start + 4 + 16 * 1.2e6 * c["width"] ** 2 / 1e9  # 30 steps, then writing a checkpoint (~16 B/param)
    if c["lesson"] == "03":
        return start + DP_STEPS * 0.3 + 5  # worst case seen: ~0.3 s per step without peer access
    epoch = (2.5 if c["path"] == "dataloader" else 0.27) / c["gpus"] ** 0.85 * (3.5 if c["lesson"] == "05" else 1)
    return start + epochs * (epoch + (0.8 if c["path"] == "dataloader" else 0.2))


def key(c: dict, quick: bool, data: str) -> str:
    return "/".join([c["suite"], c["lesson"], f"{c['gpus']}{'cpu' if quick else 'gpu'}", c["variant"], data])


def run_one(c: dict, args, runs_dir: Path, timeout: float) -> dict:
    """Run one lesson script in a fresh folder; return its row (status ok, failed or timeout)."""
    name = c["key"].replace("/", "_")
    run_dir = runs_dir / name
    for i in range(2, 1000):  # a fresh folder: a fresh run into old checkpoints is refused by the scripts
        if not run_dir.exists():
            break
        run_dir = runs_dir / f"{name}-{i}"
    run_dir.mkdir(parents=True)
    flags = ["--data", args.data, "--data-dir", args.data_dir, "--output-dir", run_dir,
             "--device", "cpu" if args.quick else "cuda"] + (shrink(c["flags"]) + QUICK_SAMPLES if args.quick else c["flags"])
    # One process needs no torchrun (the scripts default to a world of 1): one interpreter start less per run.
    launcher = [sys.executable] if c["nproc"] == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={c['nproc']}"]
    cmd = launcher + [SCRIPTS[c["lesson"]]] + [str(f) for f in flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1" if args.quick else "4"}
    if not args.quick:  # lesson 03 drives every GPU it sees; the others pick theirs by local rank
        devices = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if os.environ.get("CUDA_VISIBLE_DEVICES") \
            else [str(i) for i in range(c["gpus"])]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[:c["gpus"]])
    start, status = time.perf_counter(), "ok"
    with open(run_dir / "output.log", "w") as log:
        # Its own session: on a timeout the whole group (torchrun and its workers) is stopped, nothing else.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = "ok" if proc.wait(timeout=timeout) == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "timeout"
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall = time.perf_counter() - start
    output = (run_dir / "output.log").read_text(errors="replace")
    for heavy in [run_dir / "checkpoints", run_dir / "model_full.pt"]:  # width 10: ~1.4 GB a run, disk is small
        shutil.rmtree(heavy, ignore_errors=True) if heavy.is_dir() else heavy.unlink(missing_ok=True)
    row = {k: v for k, v in c.items() if k != "flags"}
    row.update(status=status, wall_seconds=wall, data=args.data, run_dir=str(run_dir),
               command=" ".join(["python" if c["nproc"] == 1 else f"torchrun --nproc_per_node={c['nproc']}"] +
                                [str(x) for x in cmd[len(launcher):]]),
               gpu_paths=[ln.strip() for ln in output.splitlines() if "GPU 0 <-> GPU" in ln])
    metrics = run_dir / "metrics.json"
    if metrics.exists():
        row.update(from_metrics(json.loads(metrics.read_text())))
        row["bs"] = row["args"]["batch_size"] // (c["gpus"] if c["lesson"] == "03" else 1)  # as run (--quick shrinks it)
    if status == "ok" and not row.get("epochs"):
        status = row["status"] = "failed"
    if status != "ok":
        how = f"stopped after {timeout:.0f} s" if status == "timeout" else f"exit code {proc.returncode}"  # <0: a signal
        row["error"] = "\n".join(output.splitlines()[-25:] + [f"({how})"])
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", default="all", help=f"comma-separated, from {','.join(SUITES)} (default: all)")
    p.add_argument("--gpus", default=None, help="GPU counts, e.g. 1,2,4 (default: 1, 2, 4, 8 up to what is visible)")
    p.add_argument("--data", choices=("mnist", "synthetic"), default="mnist", help="real MNIST (default) or synthetic")
    p.add_argument("--data-dir", default=None, help="folder holding MNIST/raw (default: $WORKSHOP_DATA_DIR or ./data)")
    p.add_argument("--out", default=None, help="benchmarks.md, .json, plots, bench.log (default: docs; --quick: "
                   "runs/bench-quick, so smoke rows never land in docs)")
    p.add_argument("--runs-dir", default=None, help="one folder per run (default: runs/bench-<time>)")
    p.add_argument("--merge", nargs="*", default=[], help="benchmarks.json files of other runs to merge in")
    p.add_argument("--run-timeout", type=float, default=None, help="seconds before a run is stopped (default: 240)")
    p.add_argument("--budget", type=float, default=None, help="start no run that would end after this many seconds")
    p.add_argument("--commit", default=os.environ.get("BENCH_COMMIT"), help="course commit (default: git, else ?)")
    p.add_argument("--jobs", type=int, default=None, help="parallel runs, --quick only (default: 2)")
    p.add_argument("--plan", action="store_true", help="print the runs and estimated seconds, run nothing")
    p.add_argument("--report-only", action="store_true", help="only merge --merge files and write the page")
    p.add_argument("--quick", action="store_true", help="CPU smoke mode: tiny synthetic runs with gloo, for tests")
    args = p.parse_args(argv)
    suites = SUITES if args.suite == "all" else tuple(s for s in SUITES if s in args.suite.split(","))
    if unknown := set(args.suite.split(",")) - set(SUITES) - {"all"}:
        p.error(f"unknown suite(s) {sorted(unknown)}: use {','.join(SUITES)}")
    if args.quick:
        args.data = "synthetic"  # the smoke mode never pretends to be real MNIST
    args.run_timeout = args.run_timeout or (150 if args.quick else 240)
    jobs = max(1, args.jobs or 2) if args.quick else 1  # GPU timings only one at a time: runs would disturb each other
    if not args.report_only:
        todo = plan(suites, [1, 2] if args.quick else detect_gpus(args, args.plan), args.quick)
        for c in todo:
            c["key"] = key(c, args.quick, args.data)
    if args.plan:
        for c in todo:
            print(f"{estimate_seconds(c):6.0f} s  {c['key']}  {' '.join(c['flags'])}")
        return print(f"{sum(map(estimate_seconds, todo)) / 60:.1f} min estimated for {len(todo)} runs")
    out = Path(args.out or (ROOT / "runs" / "bench-quick" if args.quick else ROOT / "docs"))
    out.mkdir(parents=True, exist_ok=True)
    rows = load_rows(out / "benchmarks.json")
    for extra in args.merge:
        rows = save_rows(out / "benchmarks.json", rows, load_rows(Path(extra)))
    if args.report_only:
        return write_report(out, rows)
    info = machine_info(args.quick, args.commit)
    from common.data import default_data_dir, prepare_data
    args.data_dir = str(args.data_dir or default_data_dir())
    try:  # once, before any run: the ranks of a run never race to extract the .gz files
        prepare_data(args.data_dir, args.data, download=False)
    except Exception as e:
        raise SystemExit(f"bench: no {args.data} data in {args.data_dir}: {e}")
    runs_dir = Path(args.runs_dir or ROOT / "runs" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}")
    log, lock, t0 = open(out / "bench.log", "a"), threading.Lock(), time.perf_counter()

    def say(line: str) -> None:
        with lock:
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()
    say(f"bench: {len(todo)} runs ({','.join(suites)}) on {info['gpu']}, data {args.data} in {args.data_dir}, "
        f"runs in {runs_dir}, ~{sum(map(estimate_seconds, todo)) / 60:.1f} min estimated (GPU)")

    def one(i_c):
        i, c = i_c
        left = (args.budget or float("inf")) - (time.perf_counter() - t0)
        if estimate_seconds(c) > left:
            return say(f"[{i}/{len(todo)}] {c['key']}: SKIPPED, would pass --budget {args.budget:.0f} s")
        # A hang near the end of the budget is cut at the budget (+1 min), not at the full --run-timeout.
        try:
            row = {**run_one(c, args, runs_dir, min(args.run_timeout, max(left + 60, 30))), **info}
        except Exception as e:  # a harness bug in one run (disk full, ...) is that run's failure, not the suite's
            row = {**{k: v for k, v in c.items() if k != "flags"}, "status": "failed", "wall_seconds": 0.0,
                   "data": args.data, "command": " ".join(c["flags"]), "error": f"bench: {type(e).__name__}: {e}", **info}
        with lock:
            save_rows(out / "benchmarks.json", load_rows(out / "benchmarks.json"), [row])
        say(f"[{i}/{len(todo)}] {c['key']}: {row['wall_seconds']:.1f} s wall | {summary(row)}")
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(one, enumerate(todo, 1)))
    say(f"bench: done in {(time.perf_counter() - t0) / 60:.1f} min")
    write_report(out, load_rows(out / "benchmarks.json"))
    log.close()


def detect_gpus(args, planning: bool) -> list[int]:
    import torch
    visible = torch.cuda.device_count() or (2 if planning else 0)  # counts devices, creates no context on them
    if visible == 0:
        raise SystemExit("bench: no GPU visible; use --quick for the CPU smoke mode (or --plan)")
    return [int(g) for g in args.gpus.split(",")] if args.gpus else [n for n in (1, 2, 4, 8) if n <= visible]


if __name__ == "__main__":
    main()

"""Benchmark every lesson on 1..N GPUs (or, with --quick, on CPU) and write docs/benchmarks.md.

    make bench                                   # GPUs: 1 and 2 (and 4, 8 if present), ~5 minutes
    python benchmarks/bench.py --quick --out /tmp/b   # CPU smoke mode, used by the tests
Each configuration runs the real lesson script (python or torchrun) and reads its metrics.json.
Rows are merged into OUT/benchmarks.json, so runs on machines with more GPUs add rows.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.report import machine_info, write_report  # noqa: E402

SCRIPTS = {"02": "02_singlegpu_training/mnist_singlegpu.py", "03": "03_dp_training/mnist_dpmodel.py",
           "04": "04_ddp_training/mnist_ddpmodel.py", "05": "05_multigpu_fsdp_training/mnist_fsdpmodel.py"}


def configs(gpus: list[int], quick: bool) -> list[dict]:
    """(lesson, processes, data path, batch per process, width, extra flags) to run."""
    loader_bs, device_bs = (32, 64) if quick else (64, 512)
    rows = [dict(lesson="02", nproc=1, path="dataloader", bs=loader_bs),
            dict(lesson="02", nproc=1, path="on-device", bs=device_bs)]
    if max(gpus) >= 2 or quick:  # DP: one process over 2 devices, the batch is split between them
        rows.append(dict(lesson="03", nproc=1, gpus=2, path="dataloader", bs=2 * loader_bs))
    for n in gpus:
        rows += [dict(lesson="04", nproc=n, path="dataloader", bs=loader_bs),
                 dict(lesson="04", nproc=n, path="on-device", bs=device_bs),
                 dict(lesson="05", nproc=n, path="on-device", bs=device_bs)]
    if quick:  # the smoke mode keeps one row of each kind
        rows = [r for r in rows if r["lesson"] != "05" or r["nproc"] == 2]
    for width in ((1,) if quick else (1, 4, 8, 10)):  # memory per GPU against model size
        for lesson in ("04", "05"):
            rows.append(dict(lesson=lesson, nproc=2, path="on-device", bs=device_bs, width=width, memory=True))
    return rows


def run_one(cfg: dict, args, out: Path) -> dict:
    name = f"{cfg['lesson']}_{cfg['nproc']}p_{cfg['path']}_bs{cfg['bs']}_w{cfg.get('width', 1)}"
    run_dir = out / "runs" / name
    flags = ["--data", "synthetic", "--data-dir", args.data_dir, "--batch-size", cfg["bs"],
             "--width", cfg.get("width", 1), "--output-dir", run_dir, "--device", "cpu" if args.quick else "cuda"]
    flags += ["--epochs", 1, "--max-steps", 30] if cfg.get("memory") else ["--epochs", args.epochs]
    if cfg["path"] == "on-device":
        flags.append("--data-on-device")
    if args.quick:
        flags += ["--train-samples", 256, "--test-samples", 128, "--num-workers", 0]
    if cfg["lesson"] in ("02", "03"):
        cmd = [sys.executable, SCRIPTS[cfg["lesson"]]]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg['nproc']}",
               SCRIPTS[cfg["lesson"]]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1" if args.quick else "4"}
    if not args.quick:  # DP sees the GPUs it should use; the others see all and pick by local rank
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(cfg.get("gpus", cfg["nproc"]))))
    start = time.perf_counter()
    proc = subprocess.run(cmd + [str(f) for f in flags], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench: {name} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    m = json.loads((run_dir / "metrics.json").read_text())
    steady = m["epochs"][1:] or m["epochs"]  # epoch 1 pays for warm-up (cuDNN autotune, workers, compile)
    best = min(steady, key=lambda e: e["epoch_seconds"])
    print(f"{name}: {best['epoch_seconds']:.2f} s/epoch, {best['train_images_per_second']:,.0f} img/s", flush=True)
    return {**cfg, "name": name, "gpus": cfg.get("gpus", cfg["nproc"]), "width": cfg.get("width", 1),
            "seconds_per_epoch": best["epoch_seconds"], "images_per_second": best["train_images_per_second"],
            "peak_memory_bytes": m["peak_memory_bytes"], "test_accuracy": m["epochs"][-1]["test_accuracy"],
            "wall_seconds": time.perf_counter() - start, "device": m["device"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default=None, help="GPU counts to run, e.g. 1,2,4 (default: 1, 2, 4, 8 up to what is visible)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per throughput run; the fastest after the first counts (default: 3)")
    p.add_argument("--data-dir", default="/tmp/bench-data", help="where the synthetic MNIST is written (default: /tmp/bench-data)")
    p.add_argument("--out", default=str(ROOT / "docs"), help="folder for benchmarks.md, .json and plots (default: docs)")
    p.add_argument("--quick", action="store_true", help="CPU smoke mode: tiny runs with gloo, for tests")
    args = p.parse_args(argv)
    import torch
    visible = 2 if args.quick else torch.cuda.device_count()
    if visible == 0:
        raise SystemExit("bench: no GPU visible; use --quick for the CPU smoke mode")
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else [n for n in (1, 2, 4, 8) if n <= visible]
    if args.quick:
        gpus = [1, 2]
        args.epochs = 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [run_one(cfg, args, out) for cfg in configs(gpus, args.quick)]
    write_report(out, rows, machine_info(args.quick))


if __name__ == "__main__":
    main()

"""Lesson 04's own main(), run many times in ONE torchrun launch: time to 99% over seeds and recipe variants.

    torchrun --standalone --nproc_per_node=N benchmarks/recipe.py --data-dir DIR --seeds 1,2,3,4,5 \\
        --variant "512x6e-3=--batch-size 512 --lr 6e-3" --variant "256x6e-3=--batch-size 256" --json OUT/recipe-N.json
    torchrun ... benchmarks/recipe.py --data-dir DIR --profile OUT/course-step   # where one step of lesson 04 goes

A launch costs 10-15 s (Python, torch, CUDA, NCCL, the data); a run of the recipe costs 1-2 s. So each
worker imports the lesson script and calls its main() once per (variant, seed), as `torchrun lesson.py`
would, each call in its own key space of torchrun's store. Every run is the real lesson code: the
recipe's flags (RECIPE) plus the variant's. --profile wraps the lesson's train() for one epoch after a
warm-up epoch in torch.profiler: a chrome trace, the top operators and the milliseconds per step.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# The time-to-99% recipe: data on the GPUs, AdamW + OneCycle, 512 images per GPU, no lr scaling.
RECIPE = ["--data-on-device", "--batch-size", "512", "--optimizer", "adamw", "--lr", "6e-3", "--schedule", "onecycle",
          "--epochs", "5", "--num-workers", "0"]
TARGET = 0.99  # time to target: the training seconds of the epochs up to the first one at or above it


def time_to_target(epochs: list[dict]) -> float | None:
    """Warm-up excluded, test after every epoch; the run goes on to its last epoch (its final accuracy counts too)."""
    done = 0.0
    for e in epochs:
        done += e["epoch_seconds"]
        if e["test_accuracy"] >= TARGET:
            return done
    return None


def lesson04():
    spec = importlib.util.spec_from_file_location("mnist_ddpmodel", ROOT / "04_ddp_training" / "mnist_ddpmodel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_once(lesson, argv: list[str], key: str, quiet: bool) -> dict:
    """lesson.main(argv) in a fresh key space of torchrun's store; its metrics record."""
    os.environ["TORCHELASTIC_RESTART_COUNT"] = key  # common.distributed.restart_safe_store prefixes the keys
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        return lesson.main(argv)


def profiled_train(lesson, out: Path, steps: int):
    """A train() that profiles `steps` optimizer steps of the lesson's second epoch (the first warms up)."""
    from torch.profiler import ProfilerActivity, profile, schedule
    original, calls = lesson.train, []

    def train(args, model, device, train_loader, *rest):
        calls.append(1)
        if len(calls) != 2:
            return original(args, model, device, train_loader, *rest)
        args.max_steps = steps  # this epoch only: the profiled steps
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities, schedule=schedule(wait=0, warmup=0, active=steps)) as prof:
            start = time.perf_counter()
            stats = original(args, model, device, train_loader, *rest)
            seconds = time.perf_counter() - start
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(out / "trace.json"))
            sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
            (out / "top_ops.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=25))
            (out / "step.json").write_text(json.dumps({"steps": steps, "ms_per_step_profiled": 1e3 * seconds / steps}))
        args.max_steps = None
        return stats
    return train


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="folder holding MNIST/raw")
    p.add_argument("--data", choices=["mnist", "synthetic"], default="mnist", help="(default: mnist)")
    p.add_argument("--seeds", default="1", help="comma-separated seeds (default: 1)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="extra lesson flags for a variant, e.g. 'bs256=--batch-size 256'; repeatable (default: the recipe)")
    p.add_argument("--extra", default="", help="flags added to every run, e.g. '--train-samples 512' (default: none)")
    p.add_argument("--json", help="rank 0 writes the rows here (rewritten after every run)")
    p.add_argument("--profile", metavar="DIR", help="profile 50 steps of the recipe's second epoch into DIR instead")
    args = p.parse_args()
    lesson = lesson04()
    variants = [v.split("=", 1) for v in args.variant] or [["recipe", ""]]
    base = RECIPE + ["--data", args.data, "--data-dir", args.data_dir] + shlex.split(args.extra)
    scratch = Path(tempfile.mkdtemp(prefix="recipe-"))
    rank = int(os.environ.get("RANK", "0"))
    if args.profile:
        lesson.train = profiled_train(lesson, Path(args.profile), steps=50)
        run_once(lesson, base + ["--epochs", "2", "--output-dir", str(scratch / "p")],
                 "profile", quiet=rank != 0)
        return
    rows = []
    for name, flags in variants:
        for seed in [int(s) for s in args.seeds.split(",")]:
            argv = base + shlex.split(flags) + ["--seed", str(seed), "--output-dir", str(scratch / f"{name}-{seed}")]
            record = run_once(lesson, argv, f"{name}-{seed}", quiet=True)
            epochs = record["epochs"]
            row = {"variant": name, "flags": flags, "seed": seed, "gpus": record["world_size"],
                   "time_to_target_seconds": time_to_target(epochs),
                   "final_accuracy": epochs[-1]["test_accuracy"], "best_accuracy": max(e["test_accuracy"] for e in epochs),
                   "epochs_run": len(epochs), "s_per_epoch": statistics.median(e["epoch_seconds"] for e in epochs),
                   "warmup_seconds": record["warmup_seconds"], "device": torch.cuda.get_device_name()
                   if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
                if args.json:
                    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

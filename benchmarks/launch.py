"""One launch's process (one per GPU): its rank, device and rows; the trainer's strategies as modules (named by the
lesson each comes from); what a row keeps of a run.

benchmarks/worker.py makes one Launch per process and hands it to the suites (benchmarks/suites.py).
"""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import io
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.tables import summary
from common.distributed import launch_env, restart_safe_store

ROOT = Path(__file__).resolve().parents[1]
# A program's key: the lesson its code comes from. The runs are the production trainer's (metrics records, warm-up,
# --max-steps), trainer/single.py ... fsdp2.py; "tools" is lesson 05's memory sweep.
LESSONS = {"02": "trainer/single.py", "03": "trainer/dp.py", "04": "trainer/ddp.py", "05": "trainer/fsdp2.py",
           "tools": "05_multigpu_fsdp_training/fsdp_memory.py"}
# --quick: the same code on the CPU in seconds (gloo, synthetic digits); its numbers are no result.
QUICK = {"--batch-size": "16", "--epochs": "1", "--max-steps": "4", "--warmup-steps": "4", "--blocks": "1",
         "--hidden": "64"}
QUICK_DATA = ["--train-samples", "256", "--test-samples", "64", "--num-workers", "0"]


class Launch:
    """This process's rank and device, the spec, and the rows rank 0 writes."""

    def __init__(self, spec: dict):
        self.spec, self.quick, env = spec, spec["quick"], launch_env()
        self.rank, self.world = env.rank, env.world_size
        self.device = torch.device("cpu") if self.quick else torch.device("cuda", env.local_rank)
        self.scratch = Path(spec["scratch"]) / f"rank{self.rank}"
        self.gpu = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.backends.cudnn.benchmark = True  # as the lessons do: fixed shapes, fastest convolutions
            torch.backends.cuda.matmul.fp32_precision = "tf32"

    def emit(self, suite: str, **row) -> None:
        if self.rank == 0:  # one line per row, appended at once: a killed launch keeps what it measured
            with open(self.spec["rows"], "a") as f:
                f.write(json.dumps({"suite": suite, "gpus": self.world, "device_name": self.gpu, **row}) + "\n")

    def sized(self, flags: list) -> list:
        """The flags as given; with --quick, CPU-sized values and a few hundred images."""
        if not self.quick:
            return [str(f) for f in flags]
        out = [str(f) for f in flags]
        for i in range(len(out) - 1):
            out[i + 1] = QUICK.get(out[i], out[i + 1])
        return out + QUICK_DATA

    def fresh(self, key: str) -> list:
        """Before a run: its own store key space, the last run's memory freed, a new peak; its common flags."""
        os.environ["TORCHELASTIC_RESTART_COUNT"] = key
        gc.collect()
        if self.device.type == "cuda":  # the lessons read max_memory_allocated: one peak per run, not per process
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        return ["--data", self.spec["data"], "--data-dir", self.spec["data_dir"], "--device", self.device.type,
                "--output-dir", str(self.scratch / key)]

    def lesson(self, number: str, flags: list, key: str) -> tuple[dict, str]:
        """lesson.main(argv) in a fresh output folder and store key space: (its metrics record, what it printed)."""
        out, argv = self.scratch / key, self.fresh(key) + self.sized(flags)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            record = module(number).main(argv)
        shutil.rmtree(out, ignore_errors=True)  # checkpoints: GBs for the big models, and never read again
        return record, printed.getvalue()

    @contextlib.contextmanager
    def group(self, name: str):
        """A process group of this launch's ranks, in its own key space of torchrun's store."""
        os.environ["TORCHELASTIC_RESTART_COUNT"] = name
        cuda = self.device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", store=restart_safe_store(launch_env()), rank=self.rank,
                                world_size=self.world, device_id=self.device if cuda else None)
        try:
            yield
        finally:
            dist.destroy_process_group()


def module(number: str):
    """A trainer module (or lesson 05's tool) as a module (cached): importing it runs nothing but its imports."""
    name = f"lesson_{number}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / LESSONS[number])
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def epochs(record: dict, batch: int, world: int) -> dict:
    """What a row keeps of a lesson's metrics record."""
    e, images = record["epochs"], record["args"].get("train_samples") or 60_000
    seconds, accuracy = [x["epoch_seconds"] for x in e], [x["test_accuracy"] for x in e]
    return {"epoch_seconds": seconds, "accuracy": accuracy, **summary(seconds, accuracy),
            "images_per_second": statistics.median(x["train_images_per_second"] for x in e),
            "warmup_s": record["warmup_seconds"],
            "peak_bytes": record["peak_memory_bytes"], "steps_per_epoch": -(-images // world // batch),
            "train_loss": e[-1]["train_loss"]}

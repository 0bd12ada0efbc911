"""The benchmark harness: its CPU smoke mode end to end, and the page it writes from GPU-like rows.

The smoke mode runs one tiny lesson script per suite (synthetic data, gloo); the GPU-only parts of the
page (peak memory, the GPU-to-GPU path, the target met or missed) are checked from hand-made rows,
since no GPU is available here.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lessons import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import report, tables  # noqa: E402

SECTIONS = ("## Target: 99% test accuracy for every seed, on 1 and 2 GPUs", "## Time to target per seed", "## The classic recipe", "## Large-batch scaling",
            "## Throughput", "## DataParallel (lesson 03)", "## Memory per GPU")
PLOTS = ("time_to_target", "accuracy", "throughput", "scaling", "memory")


def table_rows(page: str) -> list[str]:
    """The body rows of every markdown table on the page (no header, no separator)."""
    rows, block = [], []
    for line in page.splitlines() + [""]:
        if line.startswith("|"):
            block.append(line)
        else:
            rows += block[2:]
            block = []
    return rows


def test_quick_benchmark_runs_every_suite_and_labels_its_data(synthetic_dir, tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/bench.py", "--quick", "--out", str(tmp_path),
                           "--data-dir", synthetic_dir, "--runs-dir", str(tmp_path / "runs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    page = (tmp_path / "benchmarks.md").read_text()
    assert page.startswith("# Benchmarks (SYNTHETIC data")
    for section in SECTIONS:
        assert section in page
    assert "| target | GPUs | result per seed | data | status |" in page
    body = table_rows(page)
    assert len(body) >= 8 and all("| synthetic |" in line for line in body), body
    for name in PLOTS:
        assert (tmp_path / f"{name}.png").stat().st_size > 5000
    rows = json.loads((tmp_path / "benchmarks.json").read_text())["rows"]
    assert {r["suite"] for r in rows} == {"recipe", "classic", "scaling", "dp", "throughput", "memory"}
    assert all(r["status"] == "ok" and r["data"] == "synthetic" and r["images_per_second"] > 0 for r in rows)
    # time to target: the row carries what the run's metrics.json says, and the page shows it
    recipe = next(r for r in rows if r["suite"] == "recipe")
    metrics = json.loads((Path(recipe["run_dir"]) / "metrics.json").read_text())
    assert recipe["time_to_target_seconds"] == metrics["time_to_target_seconds"]
    assert recipe["warmup_seconds"] == metrics["warmup_seconds"] > 0
    shown = "not reached" if metrics["time_to_target_seconds"] is None else f"{metrics['time_to_target_seconds']:.2f} s"
    assert f"| {shown} |" in page
    assert "[1/6]" in (tmp_path / "bench.log").read_text()


def _row(suite, lesson, gpus, variant, data="mnist", **kw):
    machine = dict(gpu="NVIDIA H200", driver="580.159.04", torch="2.11.0+cu130", commit="abc1234", date="2026-11-26")
    accs = kw.pop("accs", [0.985, 0.991])
    epochs = [{"epoch": i, "train_loss": 0.1, "test_loss": 0.03, "test_accuracy": a, "test_samples": 10000,
               "epoch_seconds": 0.5, "train_images_per_second": 120000.0} for i, a in enumerate(accs, 1)]
    args = dict(optimizer="adadelta", batch_size=512, lr_scaling="none", warmup_steps=0, target_accuracy=None,
                data_on_device=True, train_samples=None, test_samples=None, max_steps=None)
    args.update(kw.pop("args", {}))
    row = dict(key=f"{suite}/{lesson}/{gpus}gpu/{variant}/{data}", suite=suite, lesson=lesson, gpus=gpus, nproc=gpus,
               variant=variant, path="on-device", bs=512, width=1, precision="fp32", seed=1, status="ok", data=data,
               wall_seconds=12.0, command=f"torchrun --nproc_per_node={gpus} 04_ddp_training/mnist_ddpmodel.py --data "
               f"{data} --seed 1 --optimizer adamw", gpu_paths=[], epochs=epochs, warmup_seconds=0.4,
               peak_memory_bytes=None, time_to_target_seconds=None, world_size=gpus, args=args,
               seconds_per_epoch=0.5, images_per_second=120000.0, epoch1_seconds=0.5, final_accuracy=accs[-1],
               train_seconds=0.5 * len(accs), **machine)
    row.update(kw)
    return row


def gpu_like_rows():
    rows = []
    for gpus, times in ((1, [1.5, 1.6, 1.9]), (2, [0.7, None, 0.9])):  # 2 GPUs: seed 2 never reached 99%
        for seed, t in zip((1, 2, 3), times):
            rows.append(_row("recipe", "04", gpus, f"seed{seed}", seed=seed, time_to_target_seconds=t,
                             accs=[0.98, 0.991] if t else [0.98, 0.985], args={"target_accuracy": 0.99}))
    rows += [_row("classic", "02", 1, "default", path="dataloader", bs=64, accs=[0.98, 0.99, 0.991]),
             _row("scaling", "04", 2, "lr-linear", args={"lr_scaling": "linear", "warmup_steps": 100}),
             _row("throughput", "04", 1, "on-device", peak_memory_bytes=600 * 2**20),
             _row("throughput", "04", 2, "on-device", images_per_second=200000.0),
             _row("dp", "03", 2, "dataloader", path="dataloader", bs=64, nproc=1,
                  gpu_paths=["warning: GPU 0 <-> GPU 1: no peer access, every copy goes through host memory"]),
             _row("memory", "05", 2, "w1-fp32", status="timeout", error="Traceback\nhang", epochs=[])]
    for lesson, peak in (("04", 661 * 2**20), ("05", 514 * 2**20)):
        rows.append(_row("memory", lesson, 2, "w1-bf16", precision="bf16", peak_memory_bytes=peak))
    return rows


def test_page_from_gpu_like_rows(tmp_path):
    rows = report.save_rows(tmp_path / "benchmarks.json", [], gpu_like_rows())
    report.write_report(tmp_path, rows)
    page = (tmp_path / "benchmarks.md").read_text()
    assert page.startswith("# Benchmarks\n") and "real MNIST" in page and "synthetic" not in page
    for section in SECTIONS + ("## Failed runs",):
        assert section in page
    targets = [line for line in page.splitlines() if line.startswith("| test accuracy >=")]
    assert len(targets) == 2 and not any(line.startswith("| time to") for line in page.splitlines())  # no limit in s
    assert targets[0].endswith("**met** |") and "seed 3: 99.10%" in targets[0]      # 1 GPU
    assert targets[1].endswith("**missed** |") and "seed 2: 98.50%" in targets[1]   # 2 GPUs
    assert "| 1.90 s |" in page and "| not reached |" in page  # each seed's time to 99%, in the per-seed table
    assert "no peer access" in page and "**TIMEOUT**" in page and "hang" in page
    assert "| 04 DDP | 2 | 512 | on-device | real MNIST |" in page and "| 1.67x |" in page
    assert all("| real MNIST |" in line for line in table_rows(page))
    for name in PLOTS:
        assert (tmp_path / f"{name}.png").stat().st_size > 5000


def test_memory_breakdown_adds_up_to_the_peak():
    n = tables.parameter_count(1)
    assert n == 1_199_882  # the classic Net
    ddp = tables.memory_breakdown(_row("memory", "04", 2, "w1", peak_memory_bytes=661 * 2**20))
    fsdp = tables.memory_breakdown(_row("memory", "05", 2, "w1", peak_memory_bytes=514 * 2**20))
    assert ddp["parameters"] == ddp["gradients"] == 4 * n and ddp["optimizer state"] == 8 * n  # Adadelta: 2 buffers
    assert fsdp["parameters"] == 2 * n and fsdp["optimizer state"] == 4 * n  # sharded over 2 GPUs
    assert ddp["data set"] == 70_000 * (784 * 4 + 8)  # every GPU holds the whole set
    parts = ("parameters", "gradients", "optimizer state", "data set", "activations and the rest")
    assert sum(ddp[p] for p in parts) == pytest.approx(661 * 2**20)


def test_merge_replaces_the_same_measurement_and_keeps_the_others(tmp_path):
    path = tmp_path / "benchmarks.json"
    first = [_row("recipe", "04", 1, "seed1"), _row("recipe", "04", 2, "seed1")]
    report.save_rows(path, report.load_rows(path), first)
    again = _row("recipe", "04", 2, "seed1", time_to_target_seconds=0.8)
    synthetic = _row("recipe", "04", 2, "seed1", data="synthetic")  # another data set: another measurement
    rows = report.save_rows(path, report.load_rows(path), [again, synthetic])
    assert len(rows) == 3 and report.load_rows(path) == rows
    assert next(r for r in rows if r["key"] == again["key"])["time_to_target_seconds"] == 0.8
    report.write_report(tmp_path, rows)
    assert "(mixed: real MNIST and synthetic)" in (tmp_path / "benchmarks.md").read_text().splitlines()[0]

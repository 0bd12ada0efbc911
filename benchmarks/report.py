"""Turn benchmark rows into docs/benchmarks.md, benchmarks.json and three PNG plots."""
from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

LESSON_NAMES = {"02": "02 single GPU", "03": "03 DataParallel", "04": "04 DDP", "05": "05 FSDP2"}


def machine_info(quick: bool) -> dict:
    import torch
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:  # no git: a copy of the course without its history
        commit = ""
    info = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "commit": commit or "?"}
    if quick or not torch.cuda.is_available():
        return {**info, "gpu": "CPU (gloo, --quick smoke mode)", "driver": "-"}
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return {**info, "gpu": torch.cuda.get_device_name(0), "driver": smi.stdout.split("\n")[0].strip() or "?"}


def _merge(out: Path, rows: list[dict], info: dict) -> list[dict]:
    """Keep rows of earlier runs (e.g. a 4- or 8-GPU machine) unless this run measured the same thing."""
    path = out / "benchmarks.json"
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    for r in rows:
        r.update(gpu_model=info["gpu"], date=info["date"], torch=info["torch"], driver=info["driver"])
    fresh = {(r["name"], r["gpus"]) for r in rows}
    merged = [r for r in old if (r["name"], r["gpus"]) not in fresh] + rows
    path.write_text(json.dumps({"rows": merged}, indent=1))
    return merged


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:,.0f} MiB"


def _baseline(rows, r):
    """The 1-GPU row of the same lesson and data path, for the scaling column."""
    lesson = "02" if r["lesson"] == "03" else r["lesson"]
    path = "dataloader" if r["lesson"] == "03" else r["path"]
    for b in rows:
        if b["lesson"] == lesson and b["path"] == path and b["gpus"] == 1 and b["width"] == r["width"] \
                and not b.get("memory") and b["bs"] * (2 if r["lesson"] == "03" else 1) == r["bs"]:
            return b
    return None


def write_report(out: Path, rows: list[dict], info: dict) -> None:
    rows = _merge(out, rows, info)
    speed = [r for r in rows if not r.get("memory")]
    memory = [r for r in rows if r.get("memory")]
    lines = ["# Benchmarks", "",
             f"Measured {info['date']} on **{info['gpu']}** (driver {info['driver']}), torch {info['torch']}, "
             f"course commit {info.get('commit', '?')}, "
             "synthetic MNIST (60k train / 10k test images), by `make bench` (`benchmarks/bench.py`).",
             "s/epoch is the fastest epoch after the first (warm-up); images/s counts all GPUs together; "
             "scaling compares with the same lesson and data path on 1 GPU.", "",
             "| lesson | GPUs | batch per GPU | data path | s/epoch | images/s | scaling vs 1 GPU | peak memory per GPU | test accuracy | GPU model |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(speed, key=lambda r: (r["lesson"], r["path"], r["gpus"])):
        base = _baseline(rows, r)
        scale = f"{r['images_per_second'] / base['images_per_second']:.2f}x" if base else "-"
        per_gpu = r["bs"] // r["gpus"] if r["lesson"] == "03" else r["bs"]
        lines.append(f"| {LESSON_NAMES[r['lesson']]} | {r['gpus']} | {per_gpu} | {r['path']} | "
                     f"{r['seconds_per_epoch']:.2f} | {r['images_per_second']:,.0f} | {scale} | "
                     f"{_mib(r['peak_memory_bytes'])} | {r['test_accuracy']:.4f} | {r['gpu_model']} |")
    lines += ["", "## Memory per GPU against model size (2 GPUs, 30 steps)", "",
              "| width | parameters | DDP peak per GPU | FSDP2 peak per GPU | FSDP / DDP |", "|---|---|---|---|---|"]
    from common.model import Net, count_parameters
    for width in sorted({r["width"] for r in memory}):
        ddp = next((r for r in memory if r["width"] == width and r["lesson"] == "04"), None)
        fsdp = next((r for r in memory if r["width"] == width and r["lesson"] == "05"), None)
        ratio = f"{fsdp['peak_memory_bytes'] / ddp['peak_memory_bytes']:.2f}" \
            if ddp and fsdp and ddp["peak_memory_bytes"] else "-"
        lines.append(f"| {width} | {count_parameters(Net(width=width)) / 1e6:.1f} M | "
                     f"{_mib(ddp and ddp['peak_memory_bytes'])} | {_mib(fsdp and fsdp['peak_memory_bytes'])} | {ratio} |")
    lines += ["", "![throughput](throughput.png)", "", "![scaling](scaling.png)", "", "![memory](memory.png)", ""]
    (out / "benchmarks.md").write_text("\n".join(lines))
    _plots(out, speed, memory)


def _plots(out: Path, speed: list[dict], memory: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{LESSON_NAMES[r['lesson']]}\n{r['path']}, {r['gpus']} GPU" for r in speed]
    ax.bar(range(len(speed)), [r["images_per_second"] for r in speed], color="tab:blue")
    ax.set_xticks(range(len(speed)), labels, rotation=60, ha="right", fontsize=7)
    ax.set(ylabel="training images/s (all GPUs)", title="Throughput by lesson, data path and GPU count")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for lesson, path in sorted({(r["lesson"], r["path"]) for r in speed if r["lesson"] in ("04", "05")}):
        pts = sorted((r["gpus"], r["images_per_second"]) for r in speed if (r["lesson"], r["path"]) == (lesson, path))
        line, = ax.plot([g for g, _ in pts], [v for _, v in pts], "o-", label=f"{LESSON_NAMES[lesson]}, {path}")
        if pts[0][0] == 1:
            ax.plot([g for g, _ in pts], [pts[0][1] * g for g, _ in pts], ":", color=line.get_color())
    ax.set_xticks(sorted({r["gpus"] for r in speed if r["lesson"] in ("04", "05")}))
    ax.set(xlabel="GPUs", ylabel="training images/s", title="Scaling (dotted: ideal, linear in GPUs)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for lesson in ("04", "05"):
        pts = sorted((r["width"], (r["peak_memory_bytes"] or 0) / 2**20) for r in memory if r["lesson"] == lesson)
        ax.plot([w for w, _ in pts], [m for _, m in pts], "o-", label=LESSON_NAMES[lesson])
    ax.set(xlabel="model width", ylabel="peak memory per GPU (MiB)", title="Memory per GPU, 2 GPUs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=100)
    plt.close(fig)

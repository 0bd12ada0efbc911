"""A run's row: what bench.py keeps of a lesson's metrics.json, and the one-line summary it prints per run."""
from __future__ import annotations


def from_metrics(m: dict) -> dict:
    """What a row keeps of metrics.json; s/epoch is the fastest epoch (epoch 1 is timed after the warm-up now)."""
    rows = m["epochs"]
    out = {"epochs": rows, "warmup_seconds": m.get("warmup_seconds"), "peak_memory_bytes": m.get("peak_memory_bytes"),
           "time_to_target_seconds": m.get("time_to_target_seconds"), "device": m.get("device"),
           "backend": m.get("backend"), "world_size": m.get("world_size"), "run_torch": m.get("torch_version"),
           "args": {k: m["args"].get(k) for k in ("optimizer", "lr", "lr_scaling", "schedule", "warmup_steps",
                                                  "target_accuracy", "epochs", "max_steps", "batch_size", "amp",
                                                  "width", "train_samples", "test_samples", "data_on_device", "seed")}}
    if rows:
        best = min(rows, key=lambda e: e["epoch_seconds"])
        out.update(seconds_per_epoch=best["epoch_seconds"], images_per_second=best["train_images_per_second"],
                   epoch1_seconds=rows[0]["epoch_seconds"], final_accuracy=rows[-1]["test_accuracy"],
                   train_seconds=sum(e["epoch_seconds"] for e in rows))
    return out


def summary(r: dict) -> str:
    if r["status"] != "ok":
        last = (r.get("error") or "").strip().splitlines()
        return f"{r['status'].upper()}: {last[-1] if last else 'no output'}"
    parts = [f"{r['seconds_per_epoch']:.2f} s/epoch", f"{r['images_per_second']:,.0f} img/s",
             f"acc {r['final_accuracy']:.4f} after {len(r['epochs'])} epoch(s)"]
    if r.get("time_to_target_seconds") is not None:
        parts.append(f"target after {r['time_to_target_seconds']:.2f} s")
    if r.get("peak_memory_bytes"):
        parts.append(f"peak {r['peak_memory_bytes'] / 2**20:,.0f} MiB")
    return ", ".join(parts)

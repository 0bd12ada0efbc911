"""The page's plots, one PNG each, drawn from the same rows as the tables; each title names the data."""
from __future__ import annotations

from pathlib import Path

from benchmarks.tables import NAMES, of


def _title(ax, text: str, rows) -> None:
    smoke = " - CPU SMOKE MODE, NOT A RESULT" if any(r.get("quick") for r in rows) else ""
    data = "real MNIST" if all(r.get("data") == "mnist" for r in rows) else "SYNTHETIC digits"
    ax.set_title(f"{text} ({data}{smoke})", fontsize=9)


def throughput(plt, rows):
    rs = sorted(of(rows, "throughput"), key=lambda r: (r["variant"], r["program"], r["gpus"]))
    if not rs:
        return None
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(range(len(rs)), [r["images_per_second"] for r in rs], color=["C0" if r["variant"] == "dataloader" else
                                                                         "C1" for r in rs])
    ax.set_xticks(range(len(rs)), [f"{NAMES[r['program']]}\n{r['gpus']} GPU, {r['variant']}" for r in rs],
                  rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("training images/s (all GPUs)")
    _title(ax, "Throughput by program, GPUs and data path", rs)
    return fig


def time_to_99(plt, rows):
    """Per seed: lesson 04 and the plain loop side by side, one panel per GPU count; x = 99% not reached."""
    rs = of(rows, "recipe") + of(rows, "plain")
    gpus = sorted({r["gpus"] for r in rs})
    if not rs:
        return None
    fig, axes = plt.subplots(1, len(gpus), figsize=(5 * len(gpus), 4), squeeze=False, sharey=True)
    for ax, n in zip(axes[0], gpus):
        series = sorted({(r["program"], r["variant"]) for r in rs if r["gpus"] == n})  # one bar per seed each
        width = 0.8 / len(series)
        for i, (program, variant) in enumerate(series):
            for r in (r for r in rs if (r["gpus"], r["program"], r["variant"]) == (n, program, variant)):
                t, x = r["time_to_99"], r["seed"] + (i - (len(series) - 1) / 2) * width
                if t is None:
                    ax.plot(x, 0, "x", color="red", ms=9, label="99% not reached")
                else:
                    ax.bar(x, t, width * 0.95, color=f"C{i}", label=f"{NAMES[program]}, {variant}")
        handles = dict(zip(*reversed(ax.get_legend_handles_labels())))
        ax.legend(handles.values(), handles.keys(), fontsize=7)
        ax.set(xlabel="seed", ylabel="training seconds to 99%")
        _title(ax, f"{n} GPU(s)", [r for r in rs if r["gpus"] == n])
    fig.tight_layout()
    return fig


def bandwidth(plt, rows):
    rs = [r for r in of(rows, "bandwidth") if r.get("sizes")]  # rows that kept the whole sweep
    if not rs:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rs:
        ax.plot(*zip(*r["sizes"]), "o-", ms=3, label=f"{r['gpus']} GPUs, {r['env'] or 'NCCL defaults'}")
    ax.set(xscale="log", yscale="log", xlabel="message bytes", ylabel="bus bandwidth GB/s")
    ax.legend(fontsize=7)
    _title(ax, "all_reduce bus bandwidth", rs)
    return fig


def fsdp_memory(plt, rows):
    """Peak memory per GPU and the bytes a rank holds, DDP against FSDP2, as the model grows (2 GPUs)."""
    rs = [r for r in of(rows, "tools") if r["group"] == 0 and r["status"] == "ok"]
    if not rs:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, field, what in zip(axes, ("peak_bytes", "held_bytes"), ("peak memory per GPU", "weights + gradients + "
                                                                     "AdamW held per rank")):
        for i, tools in enumerate(("ddp", "fsdp")):
            points = sorted((r["parameters"], r[field] / 2**30) for r in rs if r["tools"] == tools and r.get(field))
            if points:
                ax.plot(*zip(*points), "o-", color=f"C{i}", label="DDP" if tools == "ddp" else "FSDP2")
        ax.set(xscale="log", xlabel="parameters", ylabel="GiB")
        if ax.lines:
            ax.legend(fontsize=7)
        else:  # a CPU run has no GPU peak
            ax.text(0.5, 0.5, "not measured", ha="center", transform=ax.transAxes)
        _title(ax, f"{what}, 2 GPUs", rs)
    fig.tight_layout()
    return fig


PLOTS = {"throughput": (throughput, "Speed"), "time_to_99": (time_to_99, "Time to 99%"),
         "fsdp_memory": (fsdp_memory, "Tools"), "bandwidth": (bandwidth, "Communication")}


def write_all(out: Path, rows: list[dict]) -> list[tuple[str, str]]:
    """Draw the plots that have rows (removing stale ones); (name, section) of each picture on the page."""
    import matplotlib
    matplotlib.use("Agg")  # files only: GPU nodes have no display
    import matplotlib.pyplot as plt
    shown = []
    for name, (draw, section) in PLOTS.items():
        fig = draw(plt, rows)
        if fig is None:
            (out / f"{name}.png").unlink(missing_ok=True)
            continue
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
        shown.append((name, section))
    if of(rows, "overlap") and (out / "ddp_overlap.png").exists():  # drawn by the worker, from its traces
        shown.append(("ddp_overlap", "Communication"))
    return shown

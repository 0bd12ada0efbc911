"""The benchmark page's plots, one PNG each; every title carries the data the rows were measured on."""
from __future__ import annotations

from pathlib import Path

from benchmarks.tables import LESSON_NAMES, memory_breakdown

NAMES = ("time_to_target", "accuracy", "throughput", "scaling", "memory")
PARTS = ("parameters", "gradients", "optimizer state", "data set", "activations and the rest")


def _ok(rows, suite):
    return [r for r in rows if r["suite"] == suite and r["status"] == "ok"]


def _real_first(rows):
    """Where real-MNIST rows exist, only those: a synthetic run of the same measurement would overlap them."""
    return [r for r in rows if r["data"] == "mnist"] or rows


def _data(rows) -> str:
    kinds = {r["data"] for r in rows}
    return "real MNIST" if kinds == {"mnist"} else "SYNTHETIC data" if kinds == {"synthetic"} else \
        "mixed data" if kinds else "no rows"


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"{what}: not measured", ha="center", va="center", transform=ax.transAxes)
    ax.figure.empty_axes = getattr(ax.figure, "empty_axes", 0) + 1  # write_all leaves out a plot with no data


def time_to_target(plt, rows):
    """Per seed, one bar per GPU count; an x where 99% was not reached."""
    rs = _real_first(_ok(rows, "recipe"))
    fig, ax = plt.subplots(figsize=(6, 4))
    gpus, seeds = sorted({r["gpus"] for r in rs}), sorted({r["seed"] for r in rs})
    width, labelled = 0.8 / max(len(gpus), 1), set()
    for i, g in enumerate(gpus):
        for j, s in enumerate(seeds):
            r = next((r for r in rs if (r["gpus"], r["seed"]) == (g, s)), None)
            x = j + (i - (len(gpus) - 1) / 2) * width
            t = r and r.get("time_to_target_seconds")
            if t is None:
                ax.plot(x, 0, "x", color="red", ms=10)
            else:
                ax.bar(x, t, width, color=f"C{i}", label=None if g in labelled else f"{g} GPU(s)")
                labelled.add(g)
    if not rs:
        _empty(ax, "time to target")
    ax.set_xticks(range(len(seeds)), [f"seed {s}" for s in seeds])
    target = next((t for r in rs if (t := (r.get("args") or {}).get("target_accuracy"))), None)
    ax.set(ylabel="training seconds to target", title=f"Time to {f'{target:.0%}' if target else 'target'} "
           f"(lesson 04 recipe), {_data(rs)}\n"
           "x: not reached")
    _legend(ax)
    return fig


def accuracy(plt, rows):
    """Test accuracy per epoch: the large-batch rows (per GPU count and lr scaling) and the classic rows."""
    from matplotlib.ticker import MaxNLocator
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, suite, title in ((axes[0], "scaling", "Large batch: 512 per GPU, Adadelta"),
                             (axes[1], "classic", "Classic recipe: batch 64 per GPU")):
        rs = sorted(_real_first(_ok(rows, suite)), key=lambda r: (r["gpus"], r["variant"]))
        for r in rs:
            style = "--" if r["variant"] == "lr-linear" else "-"
            label = f"{r['gpus']} GPU(s), {r['variant'].replace('lr-', 'lr scaling ')}" if suite == "scaling" else \
                f"{LESSON_NAMES[r['lesson']]}, {r['gpus']} GPU(s)"
            ax.plot([e["epoch"] for e in r["epochs"]], [100 * e["test_accuracy"] for e in r["epochs"]], "o" + style,
                    color=f"C{r['gpus'] - 1}", label=label, ms=4)
        ax.axhline(99, color="grey", lw=0.8, ls=":")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if not rs:
            _empty(ax, suite)
        ax.set(xlabel="epoch", ylabel="test accuracy (%)", title=f"{title} ({_data(rs)})")
        _legend(ax)
    fig.tight_layout()
    return fig


def throughput(plt, rows):
    rs = sorted(_ok(rows, "throughput"), key=lambda r: (r["lesson"], r["path"], r["gpus"]))
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{LESSON_NAMES[r['lesson']]}\n{r['path']} {r['bs']}, {r['gpus']} GPU"
              f"{', SYNTHETIC' if r['data'] == 'synthetic' else ''}" for r in rs]
    ax.bar(range(len(rs)), [r["images_per_second"] for r in rs], color="tab:blue")
    ax.set_xticks(range(len(rs)), labels, rotation=60, ha="right", fontsize=7)
    if not rs:
        _empty(ax, "throughput")
    ax.set(ylabel="training images/s (all GPUs)", title=f"Throughput by lesson, data path and GPU count ({_data(rs)})")
    fig.tight_layout()
    return fig


def scaling(plt, rows):
    rs = _ok(rows, "throughput")
    fig, ax = plt.subplots(figsize=(6, 4))
    for lesson, path, data in sorted({(r["lesson"], r["path"], r["data"]) for r in rs if r["lesson"] in ("04", "05")}):
        pts = sorted((r["gpus"], r["images_per_second"]) for r in rs if (r["lesson"], r["path"], r["data"]) ==
                     (lesson, path, data))
        line, = ax.plot([g for g, _ in pts], [v for _, v in pts], "o-",
                        label=f"{LESSON_NAMES[lesson]}, {path}{', SYNTHETIC' if data == 'synthetic' else ''}")
        if pts[0][0] == 1:
            ax.plot([g for g, _ in pts], [pts[0][1] * g for g, _ in pts], ":", color=line.get_color())
    ax.set_xticks(sorted({r["gpus"] for r in rs if r["lesson"] in ("04", "05")}))
    if not rs:
        _empty(ax, "scaling")
    ax.set(xlabel="GPUs", ylabel="training images/s", title=f"Scaling, dotted: linear in GPUs ({_data(rs)})")
    _legend(ax)
    return fig


def memory(plt, rows):
    """Stacked bars of the breakdown, DDP and FSDP2 side by side per width; fp32 left, bf16 right."""
    rs = _real_first(_ok(rows, "memory"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, precision in zip(axes, ("fp32", "bf16")):
        sel = sorted((r for r in rs if r["precision"] == precision), key=lambda r: (r["width"], r["lesson"]))
        for x, r in enumerate(sel):
            b, bottom = memory_breakdown(r), 0.0
            for i, part in enumerate(PARTS):
                mib = max(b[part] or 0.0, 0.0) / 2**20  # an unmeasured (CPU) or negative rest draws nothing
                ax.bar(x, mib, 0.7, bottom=bottom, color=f"C{i}", label=part if x == 0 else None)
                bottom += mib
        ax.set_xticks(range(len(sel)), [f"w{r['width']}\n{'DDP' if r['lesson'] == '04' else 'FSDP2'}" for r in sel],
                      fontsize=8)
        if not sel:
            _empty(ax, precision)
        ax.set(ylabel="MiB per GPU (peak)", title=f"{precision}{' (--amp)' if precision == 'bf16' else ''}, 2 GPUs, "
               f"{_data(sel)}")
        _legend(ax)
    fig.tight_layout()
    return fig


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def write_all(out: Path, rows: list[dict]) -> list[str]:
    """Write the plots that have data (and remove stale files of those that have none); return their names."""
    import matplotlib
    matplotlib.use("Agg")  # no display on GPU nodes
    import matplotlib.pyplot as plt
    written = []
    for name in NAMES:
        fig = globals()[name](plt, rows)
        if getattr(fig, "empty_axes", 0) >= len(fig.axes):
            (out / f"{name}.png").unlink(missing_ok=True)
        else:
            fig.savefig(out / f"{name}.png", dpi=100)
            written.append(name)
        plt.close(fig)
    return written
